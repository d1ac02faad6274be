"""Planting a divergence: add a chosen amount to one module's output, for one request, at one replayed step.

`--plant STEP:REQUEST:MODULE:SIZE` (e.g. `12:req-3:layers.2.mlp.down_proj:1e-3`: add 1e-3 to the largest element
of each of that module's output rows for request req-3 at step 12) lets a user check that their
pipeline catches what it should, and lets the tests prove the diff finds exactly what was planted. A planted leak,
`12:req-3:layers.2.mlp:0.05*req-1`, adds 0.05 times the mean of req-1's output rows of that module to each of
req-3's instead: a contamination (`bisect leak` finds it; nothing moves when req-1 is not in the batch); and
`12:req-3:layers.2.mlp:1e-4*#batch` adds 1e-4 times the number of tokens in the batch, a fault of the batch's
shape alone (batch variance: `bisect leak` must not call it contamination). The planted step
is executed twice by the builtin runner: once with the perturbation (its outputs are the ones compared) and once
clean after restoring the runner's state, so the KV cache and generators carry no trace of it and, in forced mode, no
other step can differ. On vLLM's runner (module names are vLLM's: `model.layers.1.mlp.down_proj`,
`logits_processor`) the step runs once, with the fault added in every worker (`integrations.vllm.taps`): vLLM's
state cannot be rolled back, so the request's K/V of that step keep the fault, as a real fault's would, and later
steps of the request may differ too. The first divergence is the planted step either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from replay.errors import UsageError
from replay.integrations.vllm.taps import BATCH

if TYPE_CHECKING:
    from replay.capture import Step
    from replay.contracts import ModelRunnerOutput
    from replay.engine.model_runner import ModelRunner
    from replay.replayer.build import BuiltRunner
    from replay.replayer.loop import StepLoop


class Plant(msgspec.Struct, frozen=True):
    """Where and how much to perturb."""

    step: int
    request: str  # external or internal request id
    module: str  # a module name of the model, e.g. "layers.2.mlp.down_proj", "norm", "lm_head"
    size: float  # added to the largest element of each of the module's output rows of that request
    # a neighbour (external or internal id): size x the mean of its rows is added instead (a leak); BATCH: size x the
    # batch's token count is added (a fault of shape alone)
    source: str = ""

    @classmethod
    def parse(cls, text: str) -> Plant:
        """STEP:REQUEST:MODULE:SIZE, or STEP:REQUEST:MODULE:SIZE*NEIGHBOUR for a leak (the request id may itself
        contain ':' characters)."""
        parts = text.split(":")
        try:
            if len(parts) < 4:
                raise ValueError
            size, _, source = parts[-1].partition("*")
            return cls(int(parts[0]), ":".join(parts[1:-2]), parts[-2], float(size), source)
        except ValueError:
            raise UsageError(f"--plant {text!r}: expected STEP:REQUEST:MODULE:SIZE, or SIZE*NEIGHBOUR (a leak) or "
                             "SIZE*#batch (a fault of the batch's size), e.g. 12:req-3:layers.1.mlp:1e-3") from None

    def describe(self) -> str:
        """What is added, in words."""
        if self.source == BATCH:
            return f"{self.size:g} x the batch's tokens added to {self.module} for request {self.request}"
        if self.source:
            return f"{self.size:g} x {self.source}'s rows added to {self.module} for request {self.request}"
        return f"{self.size:g} added to {self.module} for request {self.request}"

    def taps(self, internal: dict[str, str]) -> tuple[str, float, str]:
        """(module, size, the source's internal id or "") for the hooks on vLLM's runner."""
        return self.module, self.size, self.resolved(internal).source

    def resolved(self, internal: dict[str, str]) -> Plant:
        """The plant with its neighbour named by its internal id (`internal`: external id -> internal id)."""
        if not self.source or self.source == BATCH:
            return self
        return msgspec.structs.replace(self, source=internal.get(self.source, self.source))


def install(plant: Plant, runner: ModelRunner, internal_id: str) -> Any:
    """Register the perturbing forward hook on the builtin runner's model; returns the handle to remove it. A leak's
    `source` is an internal id; nothing is added in a step where it is not scheduled."""
    import torch

    modules = dict(runner.model.named_modules())
    if plant.module not in modules:
        names = [n for n in modules if n][:8]
        raise UsageError(f"--plant: the model has no module {plant.module!r} (modules are named like "
                         f"{', '.join(names)}, ...)")

    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            return output
        # Only the largest element of each row moves: a constant added to a whole row of logits would vanish in
        # the log-softmax, another element may be one nothing downstream can see (the logit of a token of
        # probability 1e-10), and a fault rarely hits every element alike.
        def rows_of(rid: str) -> torch.Tensor:
            if plant.module == "lm_head":  # one row per request, in batch order
                return torch.tensor([i for i, r in enumerate(runner.current_rows) if r == rid], dtype=torch.long)
            start, end = runner.current_spans[rid]
            return torch.arange(start, end)

        out = output.clone()
        flat = out.view(out.shape[0], -1)
        rows = rows_of(internal_id)
        if plant.source and plant.source != BATCH:
            if plant.source in runner.current_spans:
                flat[rows] += plant.size * flat[rows_of(plant.source)].mean(dim=0)
            return out
        cols = flat[rows].argmax(dim=1)
        flat[rows, cols] += plant.size * (flat.shape[0] if plant.source == BATCH else 1)
        return out

    return modules[plant.module].register_forward_hook(hook)


def run_planted(built: BuiltRunner, loop: StepLoop, step: Step, plant: Plant) -> ModelRunnerOutput:
    """Run one step (with its recorded grammar bitmask), with the planted perturbation when this is its step."""
    so, grammar = step.scheduler_output, step.grammar_output
    if plant.step != step.index:
        return built.runner.run_step(so, grammar)
    rid = loop.internal.get(plant.request, plant.request)
    if rid not in so.num_scheduled_tokens:
        raise UsageError(f"--plant: request {plant.request!r} is not scheduled in step {step.index}")
    if built.kind == "vllm":
        vllm = built.runner
        vllm.start_taps(rid, modules=False, plant=plant.taps(loop.internal))
        try:
            out = vllm.run_step(so, grammar)
        except BaseException:
            vllm.finish_taps(check=False)
            raise
        vllm.finish_taps()  # and checks that the fault was added
        return out
    runner = built.builtin("--plant")
    snap = runner.snapshot_step(so)
    handle = install(plant.resolved(loop.internal), runner, rid)
    try:
        planted = runner.run_step(so, grammar)
    finally:
        handle.remove()
    runner.restore_step(snap)
    runner.run_step(so, grammar)  # the clean run leaves the state (KV, generators) as if nothing was planted
    if not loop.forced:  # ...but in free mode the planted tokens go on, as a real fault's would
        for rid_, toks in zip(planted.req_ids, planted.sampled_token_ids):
            st = runner.requests.get(rid_)
            if toks and st is not None:
                st.output_token_ids[-len(toks):] = toks
    return planted
