"""Recorded features a runner cannot honour, found before the first step: a replay refuses them by name instead of
blaming the numerics for what is really a missing feature (`--force` replays anyway and lists what it ignored).

Every feature here changes what the model computes or which tokens a step emits: a LoRA adapter (the runner would
compute without it), multimodal inputs and prompt embeddings (the capture keeps only a summary of the first, and no
runner feeds the second back yet), a pooling request (no sampled tokens to compare), and speculative decoding
(draft tokens scheduled for verification: a step emits several tokens per request). What each runner supports is
listed in `SUPPORTED`; today neither runner replays any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.capture import CaptureReader, RequestAdded, Step
from replay.contracts import NewRequestData, Opaque

SUPPORTED: dict[str, frozenset[str]] = {"builtin": frozenset(), "vllm": frozenset()}
FEATURES = ("LoRA", "multimodal inputs", "prompt embeddings", "pooling", "speculative decoding")


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


def lora_adapter(opaque: Opaque) -> str:
    """What a capture kept of a request's LoRARequest, for people: its name, id and path where they survived."""
    if opaque.type.endswith("LoRARequest"):
        return opaque.summary[:120]
    # vLLM's LoRARequest is an array-like Struct: its image [name, id, path] fills an Opaque's three fields
    name, int_id, path = opaque.type, opaque.size, opaque.summary
    return f"adapter {name!r}" + (f" (id {int_id}" + (f", {path})" if path else ")") if int_id is not None else "")


def _request_features(r: NewRequestData) -> list[tuple[str, str]]:
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


def unreplayable(reader: CaptureReader, runner: str) -> list[Unreplayable]:
    """Every feature of the capture `runner` ("builtin" | "vllm") cannot honour, with its first use, in the order
    of FEATURES. Reads the steps once (a damaged tail ends the scan: the replay reports the damage itself)."""
    supported = SUPPORTED.get(runner, frozenset())
    first: dict[str, Unreplayable] = {}
    uses: dict[str, int] = {}
    external: dict[str, str] = {}
    try:
        for rec in reader.records():
            if isinstance(rec, RequestAdded):
                external[rec.request.request_id] = rec.request.external_req_id or rec.request.request_id
            if not isinstance(rec, Step):
                continue
            so = rec.scheduler_output
            for r in so.scheduled_new_reqs:
                for feature, detail in _request_features(r):
                    uses[feature] = uses.get(feature, 0) + 1
                    rid = external.get(r.req_id, r.req_id)
                    first.setdefault(feature, Unreplayable(feature, rid, rec.index, detail))
            drafts = sum(len(t) for t in so.scheduled_spec_decode_tokens.values())
            if drafts:
                uses["speculative decoding"] = uses.get("speculative decoding", 0) + 1
                first.setdefault("speculative decoding", Unreplayable(
                    "speculative decoding", "", rec.index, f"{drafts} draft token(s) scheduled for verification"))
            if so.scheduled_encoder_inputs and "multimodal inputs" not in first:
                uses["multimodal inputs"] = uses.get("multimodal inputs", 0) + 1
                first["multimodal inputs"] = Unreplayable("multimodal inputs", "", rec.index, "encoder inputs scheduled")
    except Exception:  # noqa: BLE001 - damage: the replay itself reads the prefix and reports what was lost
        pass
    out = []
    for feature in FEATURES:
        u = first.get(feature)
        if u is not None and feature not in supported:
            out.append(Unreplayable(u.feature, u.request, u.step, u.detail, uses[feature]))
    return out
