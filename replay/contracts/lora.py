"""What a capture keeps of a request's LoRA adapter (vLLM's `LoRARequest`), read back from its `Opaque`."""

from __future__ import annotations

from replay.contracts.arrays import Opaque


def lora_fields(opaque: Opaque) -> tuple[str, int, str] | None:
    """(lora_name, lora_int_id, lora_path) of a request's recorded LoRARequest. vLLM's LoRARequest is an array-like
    Struct: its msgpack image [name, id, path, ...] lands in the three fields of our `Opaque`; a LoRARequest kept
    as a summary (`Opaque.of`) names its type instead, and its fields are not known (None)."""
    if opaque.type.endswith("LoRARequest") or opaque.size is None or not opaque.summary:
        return None
    return opaque.type, int(opaque.size), opaque.summary
