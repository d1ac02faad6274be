"""Where a replay that has to reach step S starts: at the nearest keyframe at or before S, so that a bisect deep in
a long capture does not replay it from step 0 for every test (docs/design.md, "The flight recorder"). A capture
that starts later than step 0 (a ring's snapshot or segment) can only start at the keyframe it opens with; one with
no keyframe before S starts at step 0; `from_start` asks for step 0 where there is one. A bisect that leaves a
request's neighbours out of every step up to S, or gives them other content, cannot do either to those live at its
keyframe (it rebuilds them): they stay as recorded, and the notes name them. Where that is every one of them, it
would test nothing, so it starts before they were scheduled (`clear_of`).

Requests live at the keyframe carry K/V rebuilt by priming (`replayer.prime`), so they are compared within the
rebuild tolerance and named; the others see the recorded batches and compare as from step 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from replay.capture import CaptureReader, Header, Keyframe, Record, Step
from replay.capture.reading.keyframe_seek import chunks_from, keyframe_steps
from replay.errors import UsageError
from replay.replayer.build import Runner
from replay.replayer.loop import StepLoop
from replay.replayer.prime import MIN_PRIME_BUDGET

OPENING = "where this snapshot or segment opens"


@dataclass(frozen=True, slots=True)
class Start:
    """The keyframe a replay starts at (None: step 0) and why, in words for the verdict."""

    keyframe: int | None
    why: str = ""


def start_at(reader: CaptureReader, first: int | None, *, from_start: bool = False) -> Start:
    """Where a replay that must reach step `first` starts (None: it replays everything, from the beginning).
    Raises UsageError for a capture that starts past step 0 without a keyframe there."""
    opens = _first_step(reader)
    if opens is not None and opens > 0:
        if opens not in keyframe_steps(reader):
            raise UsageError(f"{reader.path}: capture starts at step {opens} without a keyframe there: a "
                             "SchedulerOutput is a diff against state the runner never saw")
        opening = Start(opens, OPENING)
    else:
        opening = Start(None)
    if first is None or from_start:
        return opening
    before = [k for k in keyframe_steps(reader) if k <= first and (opening.keyframe is None or k >= opening.keyframe)]
    if not before or before[-1] == opening.keyframe:
        return opening
    return Start(before[-1], f"the nearest keyframe at or before step {first}; --from-start replays from "
                             f"{'step 0' if opening.keyframe is None else f'step {opening.keyframe}'}")


def clear_of(reader: CaptureReader, start: Start, ids: set[str], whose: str) -> Start:
    """`start`, or where every one of `ids` is live at its keyframe (a replay from there rebuilds them, so no run can
    leave them out of the steps before, nor give them other content: a bisect would test nothing) the nearest earlier
    keyframe where none of them is live yet, else step 0 where the capture opens there. Where only some are live,
    `start` stands: the others are tested, those stay as recorded (the nearest keyframe keeps a deep bisect short,
    and `--from-start` tests them all). A capture that opens at a keyframe (a ring's snapshot or segment) has nothing
    earlier: `start` then stands too. `whose`: what `ids` are, in words for the notes."""
    if start.keyframe is None or not ids:
        return start
    held = ids & live_at(reader, start.keyframe)
    if held != ids:
        return start
    opening = start_at(reader, None)
    origin = "step 0" if opening.keyframe is None else f"step {opening.keyframe}"
    for k in reversed(keyframe_steps(reader)):
        if k < start.keyframe and (opening.keyframe is None or k >= opening.keyframe) \
                and not ids & live_at(reader, k):
            return Start(k, f"the nearest keyframe before {whose} were scheduled: at the one of step "
                            f"{start.keyframe}, all {len(held)} were live, which no run can leave out; "
                            f"--from-start replays from {origin}")
    if opening.keyframe is not None:
        return start
    return Start(None, f"at every keyframe up to step {start.keyframe} some of {whose} were live, which no run can "
                       "leave out")


def live_at(reader: CaptureReader, keyframe: int) -> set[str]:
    """The requests scheduled at the keyframe of step `keyframe` (one still waiting there is first scheduled after
    it, as a replay from there sees it). Reads from the keyframe's chunk on, as the replay does."""
    kf = next((rec for rec in records_from(reader, Start(keyframe))
               if isinstance(rec, Keyframe) and rec.step == keyframe), None)
    return set() if kf is None else {x.request.request_id for x in kf.requests if x.scheduled}


def _first_step(reader: CaptureReader) -> int | None:
    """The step the capture opens at: by the index, else the first keyframe or step read (a capture cut short)."""
    span = reader.step_span()
    if span is not None or reader.index is not None:
        return span[0] if span is not None else None
    for rec in reader.records():
        if isinstance(rec, Keyframe | Step):
            return rec.step if isinstance(rec, Keyframe) else rec.index
    return None


def prime_budget(runner: Runner, header: Header) -> int:
    """Tokens a priming step prefills at most: vLLM's runner sizes its buffers by its token budget; ours has none,
    so a step as large as the recording engine's, at least `MIN_PRIME_BUDGET`."""
    return getattr(runner, "prime_budget", 0) or max(header.engine_config.max_num_batched_tokens, MIN_PRIME_BUDGET)


def records_from(reader: CaptureReader, start: Start) -> Iterator[Record]:
    """The records a replay from `start` reads: from the chunk its keyframe opens (with the index), else all."""
    if start.keyframe is None:
        return reader.records()
    return reader.records(chunks=chunks_from(reader, start.keyframe))


def loop_from(reader: CaptureReader, runner: Runner, start: Start, mode: str = "forced",
              skip: Iterable[str] = ()) -> tuple[StepLoop, Iterator[Record]]:
    """A replay loop on `runner` that starts at `start` (primed from its keyframe), and the records it reads."""
    budget = prime_budget(runner, reader.header)
    loop = StepLoop(reader.path, runner, mode, keyframe=start.keyframe, prime_budget=budget)
    loop.skip = set(skip)
    return loop, records_from(reader, start)
