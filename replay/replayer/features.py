"""Recorded features a runner cannot honour, found before the first step: a replay refuses them by name instead of
blaming the numerics for what is really a missing feature (`--force` replays anyway and lists what it ignored).

Every feature here changes what the model computes or which tokens a step emits: a LoRA adapter, multimodal inputs
and prompt embeddings (the capture keeps only a summary of the first, and no runner feeds the second back yet), a
pooling request (no sampled tokens to compare), and speculative decoding (draft tokens scheduled for verification:
a step emits several tokens per request). What each runner supports is listed in `SUPPORTED`: both re-attach or
apply LoRA adapters (`adapter_problems` first checks that each one is where the recording found it, with the same
files) and verify recorded drafts (vLLM's runner needs the speculative config the header records since format 1.2).
With `--force`, LoRA requests run without an adapter that is not there, and requests of the per-request features
the runner cannot run at all (`PER_REQUEST`) are left out of every step and not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from replay.capture import CaptureReader, Keyframe, RequestAdded, Step
from replay.contracts import EngineCoreRequest, NewRequestData, Opaque
from replay.contracts.lora import lora_fields
from replay.errors import UsageError
from replay.integrations.vllm.header import engine_adapters
from replay.provenance import adapter_fingerprint
from replay.replayer.start import Start, records_from

SUPPORTED: dict[str, frozenset[str]] = {"builtin": frozenset({"LoRA", "speculative decoding"}),
                                        "vllm": frozenset({"LoRA", "speculative decoding"})}
FEATURES = ("LoRA", "multimodal inputs", "prompt embeddings", "pooling", "speculative decoding")
PER_REQUEST = ("multimodal inputs", "prompt embeddings", "pooling")  # --force leaves these requests out


@dataclass(frozen=True, slots=True)
class Unreplayable:
    """One recorded use of a feature the runner cannot honour."""

    feature: str  # one of FEATURES
    request: str  # the first request (external id) that uses it; "" for an engine-wide feature
    step: int  # where it first appears
    detail: str  # "adapter 'sql-lora' (id 1, /adapters/sql)", "3 draft tokens scheduled", ...
    uses: int = 1  # how many requests (or steps) use it in all

    def describe(self) -> str:
        """'LoRA: request r1 at step 0 (adapter 'sql-lora'), 4 requests in all'."""
        who = f"request {self.request} at step {self.step}" if self.request else f"step {self.step}"
        more = f", {self.uses} {'requests' if self.request else 'steps'} in all" if self.uses > 1 else ""
        return f"{self.feature}: {who} ({self.detail}){more}"


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A LoRA adapter the recording's requests used."""

    name: str
    int_id: int
    path: str
    fingerprint: str  # when the request arrived (the tap hashes the adapter's files); "" when not recorded


def lora_adapter(opaque: Opaque) -> str:
    """What a capture kept of a request's LoRARequest, for people: its name, id and path where they survived."""
    fields = lora_fields(opaque)
    if fields is None:
        return opaque.summary[:120]
    name, int_id, path = fields
    return f"adapter {name!r} (id {int_id}, {path})"


def adapter_problems(adapters: list[LoRAAdapter]) -> list[tuple[LoRAAdapter, str, bool]]:
    """Why a recorded adapter cannot be re-attached as it was: (adapter, one line naming it, whether it can still be
    attached as it is now). Not there or unreadable: it cannot; its files changed: it can, with other weights."""
    out = []
    for a in adapters:
        if not Path(a.path).is_dir():
            out.append((a, f"LoRA adapter {a.name!r}: {a.path} is not there", False))
            continue
        try:
            now = adapter_fingerprint(a.path)
        except UsageError as e:
            out.append((a, f"LoRA adapter {a.name!r}: {e}", False))
            continue
        if a.fingerprint and now != a.fingerprint:
            out.append((a, f"LoRA adapter {a.name!r}: {a.path} changed since the recording (fingerprint "
                           f"{a.fingerprint[:12]} recorded, {now[:12]} now)", True))
    return out


def _request_features(r: NewRequestData | EngineCoreRequest) -> list[tuple[str, str]]:
    out = []
    if r.lora_request is not None:
        out.append(("LoRA", lora_adapter(r.lora_request)))
    if r.mm_features:
        out.append(("multimodal inputs", f"{len(r.mm_features)} feature(s): {r.mm_features[0].type}"))
    if r.prompt_embeds is not None or r.prompt_token_ids is None:
        shape = "x".join(map(str, r.prompt_embeds.shape)) if r.prompt_embeds is not None else "?"
        out.append(("prompt embeddings", f"embeddings of shape {shape}"))
    if r.pooling_params is not None:
        out.append(("pooling", r.pooling_params.type))
    return out


def unreplayable(reader: CaptureReader, runner: str, start: Start | None = None,
                 last: int | None = None) -> tuple[list[Unreplayable], list[LoRAAdapter], set[str]]:
    """Every feature of the capture `runner` ("builtin" | "vllm") cannot honour, with its first use, in the order
    of FEATURES; the LoRA adapters it uses, by first use; and the requests (internal ids) a `--force` replay
    leaves out because the runner cannot run them at all (prompt embeddings, multimodal inputs, pooling: LoRA
    requests run without their adapter instead). Reads the steps a replay from `start` to step `last` reads (all
    of them by default) once, and the requests its keyframe rebuilds (a damaged tail ends the scan: the replay
    reports the damage itself)."""
    supported = set(SUPPORTED.get(runner, frozenset()))
    ec = reader.header.engine_config
    if runner == "vllm" and (ec is None or "max_lora_rank" not in ec.layout):  # recorded before the LoRA settings
        supported.discard("LoRA")
    if runner == "vllm" and (ec is None or "speculative_args" not in ec.layout):  # recorded before the spec config
        supported.discard("speculative decoding")
    first: dict[str, Unreplayable] = {}
    uses: dict[str, int] = {}
    external: dict[str, str] = {}
    fingerprints: dict[str, str] = {}  # internal request id -> adapter fingerprint recorded at arrival
    adapters: dict[tuple, LoRAAdapter] = {}
    if runner == "vllm":  # the engine's own adapters fill its LoRA slots before any request's (its runner loads them)
        adapters = {(n, i, p): LoRAAdapter(n, i, p, fp) for n, i, p, fp in engine_adapters(reader.header)}
    users: dict[str, set[str]] = {}  # per-request feature -> internal ids of the requests that use it

    def scheduled(rid: str, r: NewRequestData | EngineCoreRequest, step: int) -> None:
        fields = lora_fields(r.lora_request) if r.lora_request is not None else None
        if fields is not None and fields not in adapters:
            adapters[fields] = LoRAAdapter(*fields, fingerprints.get(rid, ""))
        elif r.lora_request is not None and fields is None:  # only a summary was kept: nothing to attach
            supported.discard("LoRA")
        for feature, detail in _request_features(r):
            uses[feature] = uses.get(feature, 0) + 1
            users.setdefault(feature, set()).add(rid)
            first.setdefault(feature, Unreplayable(feature, external.get(rid, rid), step, detail))

    try:
        for rec in reader.records() if start is None else records_from(reader, start):
            if isinstance(rec, Keyframe) and start is not None and rec.step == start.keyframe:
                for x in rec.requests:  # the requests it rebuilds run on from there
                    external[x.request.request_id] = x.request.name
                    fingerprints[x.request.request_id] = x.request.lora_fingerprint
                    if x.scheduled:
                        scheduled(x.request.request_id, x.request, rec.step)
            if isinstance(rec, RequestAdded):
                external[rec.request.request_id] = rec.request.name
                fingerprints[rec.request.request_id] = rec.request.lora_fingerprint
            if not isinstance(rec, Step):
                continue
            if last is not None and rec.index > last:
                break
            so = rec.scheduler_output
            for r in so.scheduled_new_reqs:
                scheduled(r.req_id, r, rec.index)
            drafts = sum(len(t) for t in so.scheduled_spec_decode_tokens.values())
            if drafts:
                uses["speculative decoding"] = uses.get("speculative decoding", 0) + 1
                first.setdefault("speculative decoding", Unreplayable(
                    "speculative decoding", "", rec.index, f"{drafts} draft token(s) scheduled for verification"))
            if so.scheduled_encoder_inputs and "multimodal inputs" not in first:
                uses["multimodal inputs"] = uses.get("multimodal inputs", 0) + 1
                first["multimodal inputs"] = Unreplayable("multimodal inputs", "", rec.index,
                                                          "encoder inputs scheduled")
    except Exception:  # noqa: BLE001 - damage: the replay itself reads the prefix and reports what was lost
        pass
    out = []
    skip: set[str] = set()
    for feature in FEATURES:
        u = first.get(feature)
        if u is not None and feature not in supported:
            out.append(Unreplayable(u.feature, u.request, u.step, u.detail, uses[feature]))
            if feature != "LoRA":
                skip |= users.get(feature, set())
    return out, list(adapters.values()), skip
