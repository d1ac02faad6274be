"""`show_steps`: pick steps (and a request's part in them) out of a capture (`replay show`)."""

from __future__ import annotations

import itertools
import os

import msgspec

from replay.capture import CaptureReader, Crash, Damage, Keyframe, RequestAdded, Step, StepRange
from replay.errors import CaptureError, UsageError
from replay.inspect.response_ids import response_prompts


class ShownSteps(msgspec.Struct):
    """Steps selected for display, with the external ids of the requests they mention (when seen)."""

    path: str
    steps: list[Step]
    external_ids: dict[str, str]  # internal request id -> the user's id, from the arrivals and keyframes read
    request: str | None  # the internal id selected with --request, if any
    damage: list[Damage]
    crashes: dict[int, Crash] = {}  # step index -> what the engine raised executing it (for the steps shown)


def show_steps(path: str | os.PathLike, rng: StepRange | None = None, request: str | None = None,
               limit: int | None = None) -> ShownSteps:
    """Steps in `rng` (all if None) that schedule or finish `request` (internal or external id; any if None), at
    most `limit` of them, with the external ids of the requests they mention. Arrivals may sit in any chunk before
    a step, so every chunk up to the range's end is read; with a seek index, steps outside the range are skipped
    before they are decoded and chunks past the range are not read. Raises CaptureError when nothing matches."""
    with CaptureReader(path) as r:
        ext: dict[str, str] = {}
        crashes: dict[int, Crash] = {}
        out: list[Step] = []
        internal = request
        chunks = None
        if r.index is not None and rng is not None and rng.last is not None:
            last = rng.last
            chunks = itertools.takewhile(lambda ref: not (ref.info.num_steps and ref.info.first_step > last),
                                         r.iter_chunks())
        keep = None if rng is None else (lambda index: index in rng)
        for rec in r.records(chunks=chunks, keep_step=keep):
            if isinstance(rec, Crash):
                crashes[rec.step] = rec
                continue
            if isinstance(rec, RequestAdded | Keyframe):  # (a keyframe's live requests arrived before it)
                for arrival in [rec.request] if isinstance(rec, RequestAdded) else [x.request for x in rec.requests]:
                    rid, eid = arrival.request_id, arrival.external_req_id and arrival.name
                    if eid is not None:
                        ext[rid] = eid
                        if request is not None and eid == request:
                            internal = rid
                continue
            if not isinstance(rec, Step) or (rng is not None and rec.index not in rng):
                continue
            so = rec.scheduler_output
            if internal is not None and internal not in so.num_scheduled_tokens and internal not in so.finished_req_ids:
                continue
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
        if not out and request is not None and internal == request:
            # no request has that name: an OpenAI response's id, whose one prompt is its engine's request `name-0`
            prompts = response_prompts(request, ext.values())
            if len(prompts) == 1:
                return show_steps(path, rng, prompts[0], limit)
            if prompts:
                raise UsageError(f"{path}: {request!r} is an OpenAI response with {len(prompts)} prompts; name one "
                                 f"of its requests: {', '.join(prompts[:4])}")
        if not out:
            what = f"step {rng.first}" if rng is not None and rng.last == rng.first else \
                f"steps {rng}" if rng is not None else "step"
            who = f" scheduling request {request!r}" if request is not None else ""
            lost = f" (the capture is damaged: {r.damage[0].describe()})" if r.damage else ""
            raise CaptureError(path, f"no {what}{who} in this capture{lost}")
        shown = {s.index for s in out}
        return ShownSteps(str(path), out, ext, internal, list(r.damage),
                          {i: c for i, c in crashes.items() if i in shown})
