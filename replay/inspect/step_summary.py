"""`StepSummary`: what one step did to each request, in vLLM's terms: tokens scheduled and how many of them were
prefill (prompt, or outputs recomputed after a preemption) rather than decode, prefix-cache hits, requests new,
resumed, preempted and finished, tokens sampled. A few dicts per step instead of the record (logprobs and all),
so a whole capture's worth fits in memory for the timeline export (`replay.inspect.perfetto`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replay.capture import Step, StepTiming
from replay.contracts import EngineCoreRequest, SamplingParams


@dataclass(slots=True)
class StepSummary:
    """One step, summarised."""

    index: int
    timing: StepTiming | None  # None also when the capture recorded no start time
    scheduled: dict[str, int]  # req_id -> num_scheduled_tokens
    prefill: dict[str, int] = field(default_factory=dict)  # req_id -> of those, prefill tokens
    computed: dict[str, int] = field(default_factory=dict)  # req_id -> num_computed_tokens before the step
    generated: dict[str, int] = field(default_factory=dict)  # req_id -> tokens sampled (absent: none)
    cached_prefix: dict[str, int] = field(default_factory=dict)  # new req_id -> tokens found in the prefix cache
    new: int = 0  # requests scheduled for the first time
    resumed: set[str] = field(default_factory=set)  # back after a preemption
    preempted: set[str] = field(default_factory=set)  # recorded (preempted_req_ids), then inferred ones
    finished: set[str] = field(default_factory=set)  # finished_req_ids: finished since the previous step
    ran: bool = True  # False: no ModelRunnerOutput (nothing scheduled, or the step crashed)


def prefill_tokens(n: int, computed: int, prompt_len: int | None, outputs: int) -> int:
    """Of `n` tokens scheduled from position `computed` of a request with `outputs` output tokens so far, how many
    are prefill work. The newest output token is the decode input; every position before it not yet computed is
    prompt, or output recomputed after a preemption."""
    if outputs == 0:
        end = prompt_len if prompt_len is not None else computed + n
    elif prompt_len is not None:
        end = prompt_len + outputs - 1
    else:  # the prompt was never seen (the tap attached mid-run): only the last token can be a decode
        end = computed + n - 1
    return max(0, min(n, end - computed))


class StepSummarizer:
    """Summarises steps in capture order, carrying what that needs from one step to the next: each request's
    prompt length and the tokens it has sampled."""

    def __init__(self) -> None:
        self.prompt_len: dict[str, int] = {}
        self.generated: dict[str, int] = {}  # req_id -> tokens sampled so far; present once scheduled
        self.params: dict[str, SamplingParams] = {}
        self.last_token: dict[str, int] = {}  # req_id -> the last token it sampled

    def add_request(self, request: EngineCoreRequest) -> None:
        """A request arrived (`RequestAdded`): its prompt length (in case its first step was lost) and sampling."""
        if request.prompt_token_ids is not None:
            self.prompt_len.setdefault(request.request_id, len(request.prompt_token_ids))
        if request.sampling_params is not None:
            self.params.setdefault(request.request_id, request.sampling_params)

    def finish_reason(self, rid: str) -> str | None:
        """Why `rid` finished ("length" or "stop") when what it sampled shows it did, else None. vLLM reports a
        finish in the next step's finished_req_ids, and a capture can end before that step."""
        sp = self.params.get(rid)
        if sp is None or rid not in self.last_token:
            return None
        if sp.max_tokens is not None and self.generated.get(rid, 0) >= sp.max_tokens:
            return "length"
        stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(sp.all_stop_token_ids or ()))
        if not sp.ignore_eos and sp.eos_token_id is not None:
            stops.add(sp.eos_token_id)
        return "stop" if self.last_token[rid] in stops and self.generated[rid] >= sp.min_tokens else None

    def summarise(self, rec: Step) -> StepSummary:
        """The summary of `rec`, the next step of the capture."""
        so, mro = rec.scheduler_output, rec.model_runner_output
        prompt_len, generated = self.prompt_len, self.generated
        timing = rec.timing if rec.timing is not None and rec.timing.start_ns > 0 else None
        s = StepSummary(rec.index, timing, dict(so.num_scheduled_tokens), finished=set(so.finished_req_ids),
                        preempted=set(so.preempted_req_ids or ()), ran=mro is not None)
        outputs: dict[str, int] = {}  # req_id -> output tokens before the step (async placeholders included)
        for n in so.scheduled_new_reqs:
            rid = n.req_id
            if n.prompt_token_ids is not None:
                prompt_len.setdefault(rid, len(n.prompt_token_ids))
            elif n.prompt_embeds is not None and n.prompt_embeds.shape:
                prompt_len.setdefault(rid, n.prompt_embeds.shape[0])
            s.computed[rid] = n.num_computed_tokens
            outputs[rid] = generated.get(rid, 0)
            if n.sampling_params is not None:
                self.params.setdefault(rid, n.sampling_params)
            if rid in generated:  # scheduled before: Model Runner V2 sends a resumed request as new again
                s.resumed.add(rid)
            else:
                s.new += 1
                if n.num_computed_tokens > 0:  # its first blocks were already in the prefix cache
                    s.cached_prefix[rid] = n.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            s.computed[rid] = cached.num_computed_tokens[i] if i < len(cached.num_computed_tokens) else 0
            outputs[rid] = (cached.num_output_tokens[i] if i < len(cached.num_output_tokens)
                            else generated.get(rid, 0))
        s.resumed |= cached.resumed_req_ids
        for rid, n in s.scheduled.items():
            s.prefill[rid] = prefill_tokens(n, s.computed.get(rid, 0), prompt_len.get(rid), outputs.get(rid, 0))
            generated.setdefault(rid, 0)
        if mro is not None:
            for rid, toks in zip(mro.req_ids, mro.sampled_token_ids):
                if toks:
                    s.generated[rid] = len(toks)
                    generated[rid] = generated.get(rid, 0) + len(toks)
                    self.last_token[rid] = toks[-1]
        return s


def infer_preemptions(steps: list[StepSummary]) -> None:
    """Add to `preempted` what the capture does not name (only Model Runner V2 fills preempted_req_ids): a request
    that comes back resumed was preempted in the first step after the last one that scheduled it."""
    last: dict[str, int] = {}  # req_id -> position of the last step that scheduled it
    marked: set[str] = set()  # preempted, by the record, and not back yet
    for pos, s in enumerate(steps):
        marked |= s.preempted
        for rid in s.resumed:
            if rid not in marked and rid in last:
                steps[min(last[rid] + 1, pos)].preempted.add(rid)
            marked.discard(rid)
        for rid in s.scheduled:
            last[rid] = pos
