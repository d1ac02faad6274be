"""`make_session`: the session on the runner the `runner` knob names (builtin by default)."""

from __future__ import annotations

import os
from collections.abc import Callable

from replay.bisect.builtin_session import StepSession
from replay.bisect.session import Session
from replay.integrations.vllm.engines import Engines
from replay.replayer.knobs import check_overrides


def make_session(path: str | os.PathLike, step: int, overrides: dict[str, str] | None = None, *,
                 force: bool = False, log: Callable[[str], None] | None = None,
                 from_start: bool = False, engines: Engines | None = None, watch: str | None = None,
                 request: str | None = None) -> Session:
    """A session on the runner the `runner` knob names (builtin by default), its replay to the step started at the
    nearest keyframe unless `from_start`; on vLLM's runner, on an engine of `engines` where one fits. `watch`: a
    request whose neighbours the runs leave out of every step up to it, or swap: where every one of them is live at
    the nearest keyframe, the replay starts before they were scheduled (`session.start_for`). `request`: the one the
    session is about; on vLLM's runner, it and the step are checked before an engine starts."""
    overrides = check_overrides(overrides or {})  # (a script's misspelt knob must not bisect as if it were unset)
    if overrides.get("runner") == "vllm":
        from replay.bisect.vllm_session import VllmStepSession

        return VllmStepSession(path, step, overrides, force=force, log=log, from_start=from_start, engines=engines,
                               watch=watch, request=request)
    return StepSession(path, step, overrides, force=force, log=log, from_start=from_start, watch=watch)
