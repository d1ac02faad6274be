"""Replaying: `build` (the Runner protocol both runners implement, and the builder that names what differs from
the recording) -> `loop` (the one replay loop, forced or free) -> `replay_capture` (`replay run`: replay and diff)
and `check` (`replay check`, the `git bisect run` predicate). `plant` perturbs one module at one step."""

from replay.replayer.build import BuiltRunner, Runner, build_runner
from replay.replayer.check import CheckResult, check_capture
from replay.replayer.knobs import KNOBS, parse_overrides
from replay.replayer.loop import MODES, StepLoop
from replay.replayer.options import ReplayOptions
from replay.replayer.plant import Plant
from replay.replayer.replay_capture import replay_capture
from replay.replayer.replay_report import ReplayReport

__all__ = ["CheckResult", "check_capture", "MODES", "StepLoop", "Plant", "ReplayOptions", "ReplayReport",
           "replay_capture", "KNOBS", "BuiltRunner", "Runner", "build_runner", "parse_overrides"]
