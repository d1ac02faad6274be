"""`--tolerance auto`: bitwise where the replay runs on the hardware the capture was recorded on, on the engine and
runner that recorded it; otherwise equal tokens and logprobs within what other kernels are measured to move them.
A capture moved to another machine is the first thing a user must rule out, and a golden test must hold on any
x86-64 machine.

Measured (docs/guide.md, "Moving captures between machines"): float32 captures recorded on an AVX512 processor replay on
an AVX2-only one (same torch 2.13.0+cpu, one thread) with equal tokens and max |Δlogprob| 4.4e-6; another Xeon
model gave 4e-6. CROSS_HARDWARE_ATOL keeps about 20x headroom over that. Half precision was not measured across
processors: its bound is about two units in the last place of a logprob near -4 in that format, and the
sentence auto prints says it is not measured."""

from __future__ import annotations

from replay.capture import Header
from replay.diff import Tolerance
from replay.provenance import HeaderDifference, hardware_differences, hardware_summary

# another engine or model runner computes with other kernels wherever it runs: bitwise is never expected there
IMPLEMENTATION = ("engine", "engine_config.runner_class")
# logprob atol across hardware, by the recorded dtype (the dtype the logits were computed in)
CROSS_HARDWARE_ATOL = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
MEASURED = {"float32": "measured 4.4e-6 across AVX512 -> AVX2"}


def auto_tolerance(recorded: Header, differences: list[HeaderDifference],
                   tie_margin: float) -> tuple[Tolerance, str]:
    """The tolerance `--tolerance auto` takes for a replay whose header differs from `recorded` by `differences`,
    and one sentence saying which it took and why."""
    hardware = recorded.environment.hardware
    known = bool(hardware) or "cpu_capability" in recorded.environment.libraries
    differ = hardware_differences(differences)
    other = [d for d in differences if d.field in IMPLEMENTATION]
    if known and not differ and not other:
        where = hardware_summary(hardware) if hardware else recorded.environment.libraries["cpu_capability"]
        return Tolerance(tie_margin=tie_margin), f"bitwise: replayed on the recording's hardware ({where})"
    dtype = recorded.model.dtype if recorded.model is not None else "float32"
    atol = CROSS_HARDWARE_ATOL.get(dtype, CROSS_HARDWARE_ATOL["float32"])
    basis = MEASURED.get(dtype, "about 2 ulp of a logprob near -4, not measured across processors")
    if other:  # (kernels, not processors, are what differ first)
        basis, why = "the cross-hardware bound", "another implementation: " + "; ".join(d.as_note() for d in other)
    else:
        why = ("; ".join(d.as_note() for d in differ[:3]) if known else
               "the recording does not name its hardware (recorded before hardware provenance)")
    return (Tolerance(atol=atol, tie_margin=tie_margin),
            f"atol {atol:g} ({dtype}, {basis}), tokens equal: {why}")
