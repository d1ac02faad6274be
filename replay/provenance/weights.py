"""The weights fingerprint: which weights a capture was recorded with, independent of engine and dtype.

It is computed from the tensors as stored (name, dtype, shape, raw bytes), before any dtype conversion, so a
checkpoint loaded in float32 and in bfloat16 has one fingerprint (the dtype is recorded separately), and the
builtin engine and the vLLM tap, which both record it, agree on it for the same checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from replay.errors import UsageError


class Fingerprint:
    """sha256 over the sorted (name, dtype, shape, sha256(raw bytes)) of named tensors, added in any order."""

    def __init__(self) -> None:
        self._entries: dict[str, str] = {}

    def add(self, name: str, t: Any) -> None:
        """Record one torch tensor as stored (its own dtype and bytes; little-endian on every platform torch
        supports)."""
        import torch

        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        dtype = str(t.dtype).removeprefix("torch.")
        self._entries[name] = f"{dtype}\0{list(t.shape)}\0{hashlib.sha256(raw).hexdigest()}"

    def hexdigest(self) -> str:
        """The fingerprint: independent of the order tensors were added and of how they were sharded."""
        h = hashlib.sha256()
        for name in sorted(self._entries):
            h.update(f"{name}\0{self._entries[name]}\n".encode())
        return h.hexdigest()


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; anything else is a UsageError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: cannot read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object")
    return data


def safetensors_files(d: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (every shard of a sharded one), in a fixed order."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UsageError(f"{index}: no weight_map")
        files = [d / f for f in sorted(set(weight_map.values()))]
        if lost := [f.name for f in files if not f.is_file()]:
            raise UsageError(f"{index}: shard(s) missing: {', '.join(lost)}")
        return files
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    raise UsageError(f"{d}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints load)")


def checkpoint_fingerprint(path: str | Path) -> str:
    """The weights fingerprint of a checkpoint directory without building the model (what other engines'
    captures record, so that replay on the builtin runner can check it loads the same weights)."""
    from safetensors import safe_open

    fp = Fingerprint()
    for f in safetensors_files(Path(path)):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                fp.add(name, st.get_tensor(name))
    return fp.hexdigest()


def adapter_fingerprint(path: str | Path) -> str:
    """The fingerprint of a LoRA adapter directory in peft's format: its tensors (every `*.safetensors`, by name
    and bytes) and its `adapter_config.json` (rank, alpha, target modules). UsageError when it cannot be read."""
    import hashlib

    from safetensors import safe_open

    d = Path(path)
    config = d / "adapter_config.json"
    files = sorted(d.glob("*.safetensors"))
    if not config.is_file() or not files:
        raise UsageError(f"{d}: not a LoRA adapter (peft format: adapter_config.json + *.safetensors)")
    fp = Fingerprint()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                fp.add(name, st.get_tensor(name))
    return hashlib.sha256(fp.hexdigest().encode() + config.read_bytes()).hexdigest()
