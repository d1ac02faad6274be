"""`check_capture`: the `git bisect run` predicate (`replay check`): 0 replays within tolerance, 1 diverges,
125 cannot test."""

from __future__ import annotations

import os

import msgspec

from replay.errors import EXIT_CANNOT_TEST, EXIT_DAMAGED, EXIT_DIVERGED, EXIT_OK, CaptureError, ReplayError
from replay.replayer.options import ReplayOptions
from replay.replayer.replay_capture import replay_capture
from replay.replayer.replay_report import ReplayReport
from replay.replayer.verdict import compared_counts


class CheckResult(msgspec.Struct):
    """The predicate's answer and why: what it compared, where it diverged, or why it could not test."""

    capture: str
    code: int  # 0 good, 1 bad, 125 cannot test
    reason: str
    report: ReplayReport | None = None
    damaged: str = ""  # a capture too damaged to replay at all (then no report): where and what it lost

    @property
    def verdict(self) -> str:
        """good | bad | cannot test."""
        return {EXIT_OK: "good", EXIT_DIVERGED: "bad"}.get(self.code, "cannot test")


def check_capture(path: str | os.PathLike, opts: ReplayOptions | None = None) -> CheckResult:
    """`git bisect run` predicate: 0 replays within tolerance, 1 diverges, 125 cannot test. Never raises for the
    capture, the model or the engine: whatever stops the replay is a reason it could not test."""
    try:
        rep = replay_capture(path, opts)
    except ReplayError as e:
        damaged = e.reason if isinstance(e, CaptureError) and e.exit_code == EXIT_DAMAGED else ""
        return CheckResult(str(path), EXIT_CANNOT_TEST, str(e), damaged=damaged)
    except Exception as e:  # noqa: BLE001 - an engine that fails to start cannot be tested, whatever the reason
        return CheckResult(str(path), EXIT_CANNOT_TEST, f"{path}: {type(e).__name__}: {e}"[:500])
    compared = compared_counts(rep)
    if rep.tolerance_choice:  # --tolerance auto says which tolerance it took
        compared += f"; tolerance {rep.tolerance_choice}"
    if not rep.diverged:
        lost = f"; data was lost ({rep.data_lost[0]}), only the readable prefix was checked" if rep.data_lost else ""
        return CheckResult(str(path), EXIT_OK, f"{path}: replays within tolerance ({compared}){lost}", rep)
    d = rep.first_divergence
    return CheckResult(str(path), EXIT_DIVERGED, f"{path}: diverges at step {d.step}, request {d.request_id} "
                       f"({d.kind}; {rep.num_divergences} divergence(s) over {compared})", rep)
