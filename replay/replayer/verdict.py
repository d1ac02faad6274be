"""The one-sentence verdicts of a replay, written once: the terminal prints them (`replay run --diff`) and the HTML
report leads with them (`replay report`), so both say the same words (`replay diff`'s: `replay.diff.captures`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay.diff.verdict import near_ties

if TYPE_CHECKING:
    from replay.replayer.replay_report import ReplayReport


def compared_counts(rep: ReplayReport) -> str:
    """'4 steps, 3 requests, 12 sampled tokens': what a verdict rests on (with no sampled token, the logprob rows
    compared instead)."""
    out = ", ".join(f"{n} {what}{'s' * (n != 1)}" for n, what in (
        (rep.steps_compared, "step"), (rep.requests_compared, "request"), (rep.tokens_compared, "sampled token")))
    rows = rep.rows_compared
    return out + (f" ({rows} logprob row{'s' * (rows != 1)}: prefills in chunks, prompt logprobs)"
                  if rows and not rep.tokens_compared else "")


def crash_verdict(rep: ReplayReport) -> str | None:
    """The recording crashed at a step and the replay did not repeat that exception: the sentence that says so
    (None when there was no recorded crash, or it was reproduced)."""
    crash = rep.crash
    if crash is None or crash.reproduced:
        return None
    then = f"raised {crash.replayed}" if crash.replayed else "ran through without an error"
    return f"DIVERGED: the recording crashed at step {crash.step} ({crash.recorded}); the replay {then}"


def rebuilt(rep: ReplayReport) -> str:
    """'; 3 requests rebuilt from the keyframe at step 72 (req-9, req-11, req-13), compared within atol 0.0001'
    ('' for a replay from step 0): a replay from a keyframe says which requests read K/V it rebuilt, and how
    closely they are held; every other request is held to the replay's own tolerance."""
    if rep.keyframe is None:
        return ""
    n = len(rep.rebuilt)
    if not n:
        return f"; from the keyframe at step {rep.keyframe}, no compared request read rebuilt K/V"
    names = ", ".join(rep.rebuilt[:6]) + (f", and {n - 6} more" if n > 6 else "")
    tol = rep.rebuild_tolerance
    return (f"; {n} request{'s' * (n != 1)} rebuilt from the keyframe at step {rep.keyframe} ({names}), compared "
            f"within atol {tol.atol:g}" if tol is not None else "")


def divergence_verdict(rep: ReplayReport) -> str | None:
    """How many divergences and token flips, and the step of the first (None when no step diverged)."""
    if rep.first_divergence is None:
        return None
    tokens = sum(s.token_mismatches for s in rep.steps)
    drafts = sum(s.draft_mismatches for s in rep.steps)
    accepted = f", {drafts} with another number of drafts accepted" if drafts else ""
    routed = sum(s.routing_mismatches for s in rep.steps)
    accepted += f", {routed} with another MoE routing" if routed else ""
    return (f"DIVERGED: {rep.num_divergences} divergence(s), {tokens} token flip(s){accepted}, first at step "
            f"{rep.first_divergence.step}{near_ties(sum(s.near_ties for s in rep.steps))}{rebuilt(rep)}")


def replay_verdict(rep: ReplayReport) -> str:
    """The sentence a replay's report leads with: MATCH, else the unreproduced crash, else the divergences."""
    if not rep.diverged:
        tol = rep.tolerance
        within = "" if tol.bitwise else f" within atol {tol.atol:g}, rtol {tol.rtol:g}"
        return (f"MATCH: every replayed step equals the recording{within}"
                + near_ties(sum(s.near_ties for s in rep.steps)) + rebuilt(rep)
                + (" (data was lost: the readable prefix matches)" if rep.data_lost else ""))
    return crash_verdict(rep) or divergence_verdict(rep) or "DIVERGED"
