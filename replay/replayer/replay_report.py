"""`ReplayReport`: what a replay found, as `replay run --diff --json` prints it and the HTML report shows it."""

from __future__ import annotations

import msgspec

from replay.diff import BatchComposition, Divergence, StepSummary, Tolerance
from replay.replayer.loop import CrashOutcome
from replay.replayer.plant import Plant


class ReplayReport(msgspec.Struct):
    """What a replay found. JSON always has `diverged`, `first_divergence` and `verdict`."""

    capture: str
    mode: str
    diverged: bool
    first_divergence: Divergence | None
    batch: BatchComposition | None  # the batch of the first divergence's step
    repro: str | None  # the command that re-runs up to that step
    tolerance: Tolerance
    environment_differences: list[str]
    steps_replayed: int
    steps: list[StepSummary]
    divergences: list[Divergence]
    num_divergences: int
    run_to_run: str | None  # with --repeat: "deterministic" or where the repeats parted
    replay_s: float
    record_execute_s: float  # the recording's own runner time for the same steps (from its timings)
    plant: Plant | None = None
    first_token_flip: Divergence | None = None  # the first divergence that changed a token, if any
    # sampled tokens of random-sampling requests that differ but cannot be compared: vLLM drew them with its own
    # sampler kernels and random streams, which only vLLM's runner repeats (not counted in num_divergences)
    foreign_draws_differ: int = 0
    # what differs but cannot change numerics by itself (platform, Python, executor backend, what the engine logged)
    host_differences: list[str] = []
    # whose sampler drew the foreign draws ("vllm" | "builtin"), when there are any; "vllm-global": vLLM's unseeded
    # draws, which a replay from a keyframe cannot repeat
    foreign_draws_by: str = ""
    crash: CrashOutcome | None = None  # the recording crashed at a step: re-executed, reproduced or not
    data_lost: list[str] = []  # what the capture lost (damaged chunks, an unfinished tail): the replay is of a prefix
    stopped: str | None = None  # where and why the replay ended before the capture's last step
    steps_compared: int = 0  # what the verdict rests on: steps diffed, requests with an output among them, and
    requests_compared: int = 0  # their sampled tokens
    tokens_compared: int = 0
    tolerance_choice: str = ""  # with --tolerance auto: which tolerance it took, and why
    # with a divergence: the leading suspect among the recording's and the replay's differences (hardware, then the
    # parallel layout and compilation, then the other numerics knobs), e.g. "tensor_parallel_size: recorded 2,
    # replay 1"; "" when they compute alike
    suspect: str = ""
    # with --force: the recorded features the runner could not honour and replayed without (LoRA adapters,
    # speculative decoding, ...; see `features`), one line each
    ignored: list[str] = []
    # from a keyframe: the step of the keyframe the replay started at (None: from step 0), the requests whose K/V it
    # rebuilt (by name: live at the keyframe, or hitting a rebuilt block), compared within `rebuild_tolerance`, and
    # the tokens it prefilled to rebuild it
    keyframe: int | None = None
    rebuilt: list[str] = []
    rebuild_tolerance: Tolerance | None = None
    primed_tokens: int = 0
    # why the foreign draws are not compared, where the recording's engine version decides it (a seeded sampler
    # the builtin runner has no port of); "" for the reason `foreign_draws_by` gives
    foreign_draws_why: str = ""
    tokens_routed: int = 0  # scheduled tokens whose MoE routing (routed_experts) was compared, exactly
    # the recording kept MoE routing that the replay did not return (a runner or vLLM that cannot): not compared
    routing_not_compared: int = 0  # steps
    keyframe_why: str = ""  # why the replay started at `keyframe`
    unknown: str = ""  # what the recording's header does not name and the replay's does (an older capture)
    rows_compared: int = 0  # logprob rows without a sampled token (partial prefills' discarded ones, prompt logprobs)
    rerun: str = ""  # the command that runs this comparison again, as it was asked for
    verdict: str = ""  # the sentence the terminal and the HTML report lead with (`replay_verdict`)

    def __repr__(self) -> str:
        # a notebook shows what the terminal leads with, not every step's summary (tens of thousands of characters)
        return (f"ReplayReport({self.capture!r}: {self.verdict or ('DIVERGED' if self.diverged else 'MATCH')}; "
                f"{self.steps_replayed} steps replayed)")
