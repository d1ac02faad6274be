"""Which difference between the recording and the replay a divergence names first (`ReplayReport.suspect`)."""

from __future__ import annotations

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
