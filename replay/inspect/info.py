"""`capture_info`: what a capture holds, how big it is, and whether any of it is damaged (`replay info`)."""

from __future__ import annotations

import os

import msgspec

from replay.capture import CaptureReader, Damage, Header, Keyframe, RequestAdded, Step
from replay.capture.format.records import Footer
from replay.contracts import DraftCounts, draft_counts


class CaptureInfo(msgspec.Struct):
    """The answer of `replay info`."""

    path: str
    format_version: str
    complete: bool  # closed cleanly: footer and seek index present
    status: str  # the footer's status, or "unfinished"
    header: Header
    num_steps: int
    first_step: int | None
    last_step: int | None
    num_requests: int  # distinct request ids scheduled in steps
    num_requests_added: int  # RequestAdded records (arrivals the tap saw)
    num_scheduled_tokens: int
    num_generated_tokens: int
    drafts: DraftCounts  # speculative decoding: draft tokens verified and accepted (zeros without it)
    num_chunks: int
    file_bytes: int
    raw_bytes: int  # uncompressed record bytes
    compression_ratio: float
    bytes_per_generated_token: float | None
    unknown_records: int
    damage: list[Damage]
    keyframes: list[int] = []  # the steps the capture's keyframes stand before (where `run --from-keyframe` starts)
    snapshot: dict | None = None  # a ring's snapshot: what triggered it, its window, what the ring had dropped

    @property
    def damaged(self) -> bool:
        """True when any data was lost (exit code 3)."""
        return bool(self.damage)


def capture_info(path: str | os.PathLike) -> CaptureInfo:
    """Summarise a capture. With a seek index the numbers come from it and every chunk's checksum is verified
    (decompressed, not decoded); without one (a crash) every record is decoded by a linear scan."""
    with CaptureReader(path) as r:
        if r.index is not None:
            chunks = r.index.chunks
            raw = 0
            for ref, data, e in r.chunk_bytes():
                if e is None:
                    raw += len(data)
                else:
                    r.damage.append(Damage.chunk_lost(ref.number, ref.offset, ref.info, e.reason))
            good = [c for i, c in enumerate(chunks) if not any(d.chunk == i for d in r.damage)]
            steps = [c for c in good if c.num_steps]
            num_steps = sum(c.num_steps for c in good)
            first = steps[0].first_step if steps else None
            last = steps[-1].last_step if steps else None
            sched = sum(c.num_scheduled_tokens for c in good)
            gen = sum(c.num_generated_tokens for c in good)
            added = sum(c.num_requests_added for c in good)
            drafts = DraftCounts(sum(c.num_draft_tokens for c in good), sum(c.num_accepted_draft_tokens for c in good))
            num_requests = len(r.index.ids) or r.index.num_requests  # (1.5 keeps the count, not the ids)
            status = r.index.status
            num_chunks = len(chunks)
            keyframes = [c.keyframe for c in good if c.keyframe >= 0]
        else:
            num_steps = sched = gen = added = raw = 0
            drafts = DraftCounts()
            first = last = None
            ids: set[str] = set()
            status = "unfinished"
            keyframes = []
            for rec in r.records():
                if isinstance(rec, Keyframe):
                    keyframes.append(rec.step)
                elif isinstance(rec, Step):
                    num_steps += 1
                    first = rec.index if first is None else first
                    last = rec.index
                    sched += rec.scheduler_output.total_num_scheduled_tokens
                    mro = rec.model_runner_output
                    if mro is not None:
                        gen += sum(len(t) for t in mro.sampled_token_ids)
                    if rec.scheduler_output.scheduled_spec_decode_tokens:
                        drafts.add(draft_counts(rec.scheduler_output, mro))
                    ids.update(rec.scheduler_output.num_scheduled_tokens)
                elif isinstance(rec, RequestAdded):
                    added += 1
                elif isinstance(rec, Footer):
                    status = rec.status
            num_requests = len(ids)
            chunk_refs = list(r.iter_chunks())
            num_chunks = len(chunk_refs)
            # (a chunk that cannot be read was already recorded as damage by records())
            raw += sum(len(data) for _, data, e in r.chunk_bytes(chunk_refs) if e is None)
        size = r.file_size
        return CaptureInfo(
            path=str(path),
            format_version=f"{r.format_version[0]}.{r.format_version[1]}",
            complete=r.complete,
            status=status,
            header=r.header,
            num_steps=num_steps,
            first_step=first,
            last_step=last,
            num_requests=num_requests,
            num_requests_added=added,
            num_scheduled_tokens=sched,
            num_generated_tokens=gen,
            drafts=drafts,
            num_chunks=num_chunks,
            file_bytes=size,
            raw_bytes=raw,
            compression_ratio=round(raw / size, 3) if size else 0.0,
            bytes_per_generated_token=round(size / gen, 2) if gen else None,
            unknown_records=r.unknown_records,
            damage=list(r.damage),
            keyframes=keyframes,
            snapshot=r.header.extra.get("snapshot"),
        )
