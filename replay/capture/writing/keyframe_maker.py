"""`KeyframeMaker`: the writer's shadow of the request table, and when to write it out as a `Keyframe` (format 1.6).

The writer folds what it writes, chunk by chunk: as each chunk is sealed, its arrivals, aborts and steps go into the
`ShadowTable` in the order they were written (a step given as a `Step` as it is; another engine's image step decoded
from its sealed record, as a reader would). When a new chunk starts and `interval` steps have passed since the last
keyframe, the shadow goes first into that chunk, so a reader can start a replay there. All of it runs where the
writer runs: in the writer process, off the engine's thread.
"""

from __future__ import annotations

import os
from typing import Any

from replay.capture.codec.columns import ColumnSource
from replay.capture.codec.outline import FoldStep, ImageOutline, SchedulerView, step_outline
from replay.capture.format import records as fmt
from replay.capture.format.keyframe import Keyframe
from replay.capture.format.shadow import ShadowTable
from replay.contracts import SchedulerOutput
from replay.errors import UsageError

KEYFRAME_ENV = "REPLAY_KEYFRAME_STEPS"  # steps between keyframes of a capture; 0: none
DEFAULT_KEYFRAME_STEPS = 4096


def keyframe_interval(value: int | None = None) -> int:
    """Steps between keyframes: `value`, else REPLAY_KEYFRAME_STEPS, else DEFAULT_KEYFRAME_STEPS; 0 writes none."""
    if value is not None:
        n = value
    else:
        raw = os.environ.get(KEYFRAME_ENV, "").strip()
        try:
            n = int(raw) if raw else DEFAULT_KEYFRAME_STEPS
        except ValueError:
            raise UsageError(f"{KEYFRAME_ENV}={raw!r}: expected a number of steps (0: no keyframes)") from None
    if n < 0:
        raise UsageError(f"keyframe interval {n}: expected 0 (none) or a positive number of steps")
    return n


class KeyframeMaker:
    """Folds sealed chunks into a shadow request table and says when a keyframe is due."""

    def __init__(self, header: fmt.Header, interval: int) -> None:
        ec = header.engine_config
        self.shadow = ShadowTable(ec.block_size, ec.enable_prefix_caching)
        self.interval = interval
        self.last = 0  # the step of the last keyframe (the capture's start is one: nothing is live before step 0)
        self.forced = False  # the next chunk starts with a keyframe, due or not (a ring's segment)
        # why keyframes stopped: a record the shadow could not fold (it would describe a state that never was)
        self.broken: str | None = None
        self._decoder = None

    def fold(self, folds: list[Any], parts: list[bytes]) -> None:
        """Fold a sealed chunk: `folds` are its records in order (another engine's steps as `ImageOutline`s, which
        point at their stored records among the chunk's `parts`)."""
        sh = self.shadow
        for f in folds:
            if self.broken:
                return
            try:
                if isinstance(f, ImageOutline):  # from the images as sent; else from the stored record
                    images = self._images()
                    step = f.outline(images, sh.watch) or step_outline(
                        fmt.WIRE_DECODER.decode(parts[f.part]), images, _columns(parts), sh.watch)
                    if isinstance(step.scheduler_output, SchedulerView) and not sh.knows(step.scheduler_output):
                        # a request scheduled with no arrival record: rebuilt from its whole NewRequestData
                        step = step._replace(scheduler_output=images.decode(f.scheduler_output, SchedulerOutput[str]))
                    f = step
                if isinstance(f, (fmt.Step, FoldStep)):
                    sh.step(f.index, f.scheduler_output, f.model_runner_output, f.drawn_seeds)
                elif isinstance(f, fmt.RequestAdded):
                    sh.add_request(f.request, f.step)
                elif isinstance(f, fmt.RequestAborted):
                    sh.abort_request(f.request_id)
            except Exception as e:  # noqa: BLE001 - the recording goes on; only its keyframes stop
                what = f"step {f.index}" if isinstance(f, (fmt.Step, FoldStep, ImageOutline)) else type(f).__name__
                self.broken = (f"no keyframes after step {sh.next_step}: {what} could not be folded "
                               f"({type(e).__name__}: {e})")[:300]

    def due(self) -> bool:
        """Whether the chunk starting now opens with a keyframe."""
        return self.due_at(self.shadow.next_step)

    def due_at(self, step: int) -> bool:
        """Whether a keyframe is due before step `step` (the open chunk is then sealed, and the next one opens with
        it)."""
        if step <= 0 or step == self.last or self.broken:
            return False
        return self.forced or (self.interval > 0 and step - self.last >= self.interval)

    def make(self) -> Keyframe:
        """The keyframe of the state before the next step (and it is no longer due)."""
        self.last = self.shadow.next_step
        self.forced = False
        return self.shadow.keyframe()

    def _images(self):
        if self._decoder is None:
            from replay.contracts.image_decoder import ImageDecoder

            self._decoder = ImageDecoder()
        return self._decoder


def _columns(parts: list[bytes]) -> ColumnSource | None:
    """A sealed chunk's logprob columns (its first record, when it has them)."""
    first = fmt.WIRE_DECODER.decode(parts[0]) if parts else None
    return ColumnSource(first) if isinstance(first, fmt.LogprobColumns) else None
