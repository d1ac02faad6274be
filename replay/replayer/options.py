"""`ReplayOptions`: how a replay runs (`replay run`'s flags), shared by `replay_capture`, `check` and the corpus."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replay.capture import StepRange
from replay.diff import DEFAULT_TIE_MARGIN, Tolerance
from replay.errors import UsageError
from replay.processes.fanout import FanOut
from replay.replayer.knobs import Knobs, check_overrides
from replay.replayer.plant import Plant

if TYPE_CHECKING:
    from replay.integrations.vllm.engines import Engines


@dataclass(slots=True)
class ReplayOptions:
    """How to replay."""

    mode: str = "forced"
    overrides: dict[str, str] = field(default_factory=dict)  # --set KNOB=VALUE
    steps: StepRange | None = None  # diff only these steps (steps before them run, steps after them do not)
    tolerance: Tolerance = field(default_factory=Tolerance)
    auto_tolerance: bool = False  # --tolerance auto: bitwise on the recording's hardware, else CROSS_HARDWARE_ATOL
    repeat: int = 1
    force: bool = False  # replay on a different model
    plant: Plant | None = None
    diff: bool = True
    progress: Callable[[int | None], None] | None = None  # each replayed step's index, then None at the end
    max_divergences: int = 1000  # kept in the report (all are counted)
    fan_out: FanOut = field(default_factory=FanOut)  # --jobs / --ray: where the 2nd..Nth --repeat replays run
    # with `steps`, a replay starts at the nearest keyframe at or before their first (its live requests rebuilt)
    # unless `from_start`; `from_keyframe` only insists that `steps` say where
    from_keyframe: bool = False
    from_start: bool = False
    # started vLLM engines this replay may reuse, and leaves its own to (`replay.integrations.vllm.engines`); they
    # stay in this process: a replay run elsewhere (another environment, a fanned-out repeat) starts its own
    engines: Engines | None = None

    def __post_init__(self) -> None:
        # what Python hands in is checked as `--set` and `--steps` are: a misspelt knob must not replay as if unset
        if not isinstance(self.overrides, dict):
            raise UsageError(f"overrides: expected a dict of knob -> value, not {type(self.overrides).__name__}")
        self.overrides = check_overrides(self.overrides)
        if self.steps is not None and not isinstance(self.steps, StepRange):
            raise UsageError(f"steps: expected a StepRange (StepRange.parse('0-3')), not {self.steps!r}")

    def with_knobs(self, overrides: Knobs | None = None, runner: str | None = None,
                   engines: Engines | None = None) -> ReplayOptions:
        """These options with knobs given as the bisects take them: `overrides` (a dict, "K=V,K=V" or a list, checked
        as `--set`) over its own, `runner` ("builtin" or "vllm") and `engines`, where given."""
        items = [f"{k}={v}" for k, v in {**self.overrides, **check_overrides(overrides)}.items()]
        return dataclasses.replace(self, overrides=check_overrides(items, runner),
                                   engines=self.engines if engines is None else engines)

    @staticmethod
    def tolerance_from(name: str | None, atol: float = 0.0, rtol: float = 0.0,
                       tie_margin: float = DEFAULT_TIE_MARGIN) -> tuple[Tolerance, bool]:
        """(`tolerance`, `auto_tolerance`) from a tolerance by name (None; "bitwise"; "auto": bitwise on the
        recording's hardware, else the cross-hardware one) and numbers, which "auto" decides itself."""
        if name not in (None, "auto", "bitwise"):
            raise UsageError(f"--tolerance {name}: use auto or bitwise (or --atol/--rtol for numbers)")
        if name is not None and (atol or rtol):
            raise UsageError(f"--tolerance {name} decides the tolerance itself: drop either it or --atol/--rtol")
        return Tolerance(atol, rtol, tie_margin), name == "auto"
