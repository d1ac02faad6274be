"""Contract objects as another engine's tap sends them: the images the vLLM plugin's engine thread encodes."""

from __future__ import annotations

import msgspec

from replay.contracts import Array, LogprobsLists, LogprobsTensors, Opaque


def as_map(x):
    """A contract object as a dataclass engine's image looks: Structs as maps, NamedTuples (`LogprobsLists`,
    `LogprobsTensors` in vLLM) as arrays, `Array`s and `Opaque`s as our encoder writes them."""
    if isinstance(x, (Array, Opaque)):
        return x
    if isinstance(x, (LogprobsLists, LogprobsTensors)):
        return [as_map(getattr(x, f)) for f in x.__struct_fields__]
    if isinstance(x, msgspec.Struct):
        return {f: as_map(getattr(x, f)) for f in x.__struct_fields__}
    if isinstance(x, (list, tuple, set)):
        return [as_map(v) for v in x]
    if isinstance(x, dict):
        return {k: as_map(v) for k, v in x.items()}
    return x
