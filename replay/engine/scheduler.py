"""`Scheduler`: vLLM v1's FCFS scheduler (`vllm/v1/core/sched/scheduler.py`) for the builtin engine.

There is no "prefill phase" and "decode phase": each request has `num_computed_tokens` and `num_tokens`, and every
step the scheduler hands out a token budget so that the first catches up with the second. That one rule covers
chunked prefill (a long prompt takes several steps), prefix caching (a hit starts `num_computed_tokens` above 0)
and decoding (one new token a step). What each step decided goes to the runner as a `SchedulerOutput`, a diff
against the runner's cached state, so the fields are filled exactly as vLLM fills them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from replay.contracts import (
    Array,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    RequestStatus,
    SchedulerOutput,
)
from replay.engine.config import SchedulerConfig
from replay.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from replay.engine.request import Request


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot for logs and tests (a subset of vLLM's `SchedulerStats`, plus our preemption count)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of blocks held by requests
    prefix_cache_stats: PrefixCacheStats  # cumulative
    num_preemptions: int  # cumulative


class Scheduler:
    """Decides, step by step, which requests run and how many of their tokens; owns requests and KV blocks."""

    def __init__(self, config: SchedulerConfig, eos_token_id: int | None = None):
        self.config = config
        self.eos_token_id = eos_token_id  # used for requests whose sampling params carry none
        self.max_model_len = config.max_model_len
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.kv_cache_manager = KVCacheManager(config)
        self.requests: dict[str, Request] = {}  # req_id -> every unfinished request
        self.waiting: deque[Request] = deque()  # new and preempted, in scheduling order
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        # Finished since the last schedule(): the runner frees their state when it sees them.
        self.finished_req_ids: set[str] = set()
        # Finished since the last update_from_output(): reported in EngineCoreOutputs.finished_requests.
        self.finished_req_ids_for_outputs: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()
        self.num_preemptions = 0

    # -- requests ------------------------------------------------------------------------------------------------

    def add_request(self, ecr: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError for one the engine can never run (vLLM's input processor checks)."""
        if ecr.request_id in self.requests:
            raise ValueError(f"request id {ecr.request_id!r} is already in the scheduler")
        request = Request.from_engine_core_request(ecr, self.eos_token_id)
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {request.request_id}: empty prompt")
        if n > self.max_model_len:
            raise ValueError(f"request {request.request_id}: prompt of {n} tokens is longer than max_model_len "
                             f"{self.max_model_len}")
        # A request that cannot fit even when it runs alone would preempt itself forever. vLLM rules this out by
        # sizing the pool for max_model_len at start-up; our pool is a knob, so check each request instead.
        longest = min(n + request.max_tokens, self.max_model_len) if request.max_tokens is not None \
            else self.max_model_len
        block_size, num_blocks = self.config.block_size, self.config.num_gpu_blocks
        if -(-longest // block_size) > num_blocks:
            raise ValueError(f"request {request.request_id}: up to {longest} tokens do not fit in {num_blocks} "
                             f"blocks of {block_size}")
        if not self.config.enable_chunked_prefill and longest > self.max_num_scheduled_tokens:
            raise ValueError(f"request {request.request_id}: up to {longest} tokens must fit one step's budget of "
                             f"{self.max_num_scheduled_tokens} when chunked prefill is off")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: str | list[str]) -> None:
        """Finish requests as aborted: their blocks are freed now, their ids go out in the next SchedulerOutput's
        finished_req_ids. Unknown or already finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = [r for rid in request_ids if (r := self.requests.get(rid)) is not None and not r.is_finished()]
        if not aborted:
            return
        gone = {r.request_id for r in aborted}
        self.running = [r for r in self.running if r.request_id not in gone]
        self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
        for request in aborted:
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None (finished requests are dropped, as in vLLM)."""
        return self.requests.get(request_id)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """True while finished ids wait to be sent to the runner in the next schedule()."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        """True while there is work for a step: unfinished requests, or finished ids the runner must still free."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def make_stats(self) -> SchedulerStats:
        """Counts, KV usage and prefix-cache hits right now."""
        return SchedulerStats(len(self.running), len(self.waiting), self.kv_cache_manager.usage,
                              replace(self.kv_cache_manager.prefix_cache_stats), self.num_preemptions)

    # -- schedule ------------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their blocks; describe it all for the runner."""
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_block_ids: dict[str, list[int]] = {}
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        kv = self.kv_cache_manager

        # First the RUNNING requests, in order: a decode wants 1 token, a chunked prefill the rest of its prompt.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget,
                                 # the input position must stay below max_model_len
                                 self.max_model_len - 1 - request.num_computed_tokens)
            if num_new_tokens <= 0:
                req_index += 1  # continue, not break: a later request may still fit
                continue
            while True:
                new_block_ids = kv.allocate_slots(request, num_new_tokens)
                if new_block_ids is not None:
                    break
                # Out of blocks: preempt the lowest-priority request, which under FCFS is the last admitted. It
                # has not been scheduled yet in this loop (or is this very request), so nothing is undone.
                preempted_req = self.running.pop()
                self._preempt_request(preempted_req)
                preempted_reqs.append(preempted_req)
                if preempted_req is request:
                    break
            if new_block_ids is None:
                break  # the request preempted itself: nothing after it is left in running
            scheduled_running_reqs.append(request)
            req_to_new_block_ids[request.request_id] = new_block_ids
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # Then the WAITING ones (new, and preempted ones coming back), unless this step already had to preempt:
        # admitting work while evicting other work would only thrash.
        if not preempted_reqs:
            while self.waiting and token_budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request = self.waiting[0]
                # Every waiting request starts from scratch (preemption reset it to 0), so look up the prefix
                # cache: a new request may share a prompt prefix, a resumed one usually finds its own blocks.
                computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
                # num_tokens, not num_prompt_tokens: a resumed request recomputes its outputs too.
                num_new_tokens = request.num_tokens - num_computed_tokens
                if not self.config.enable_chunked_prefill and num_new_tokens > token_budget:
                    break
                num_new_tokens = min(num_new_tokens, token_budget)
                if kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                self.running.append(request)
                if request.status == RequestStatus.WAITING:
                    scheduled_new_reqs.append(request)
                elif request.status == RequestStatus.PREEMPTED:
                    scheduled_resumed_reqs.append(request)
                else:
                    raise AssertionError(f"invalid status {request.status} for waiting request {request.request_id}")
                # New and resumed requests get their whole block table (hits included).
                req_to_new_block_ids[request.request_id] = kv.get_block_ids(request.request_id)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed_tokens

        assert token_budget >= 0 and len(self.running) <= self.max_num_running_reqs
        num_common_prefix_blocks = [0]
        if self.running:
            num_common_prefix_blocks = [kv.get_num_common_prefix_blocks(self.running[0].request_id,
                                                                        len(self.running))]
        new_reqs_data = [
            NewRequestData(req.request_id, req.prompt_token_ids, [], req.sampling_params, None,
                           (req_to_new_block_ids[req.request_id],), req.num_computed_tokens, None)
            for req in scheduled_new_reqs
        ]
        cached_reqs_data = self._make_cached_request_data(scheduled_running_reqs, scheduled_resumed_reqs,
                                                          req_to_new_block_ids)
        self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=[],
            preempted_req_ids={req.request_id for req in preempted_reqs},
            num_common_prefix_blocks=num_common_prefix_blocks,
        )
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def _preempt_request(self, request: Request) -> None:
        # The caller has already taken it out of `running`. Its blocks go back to the pool (cached ones stay
        # hits until evicted); it will re-prefill everything it knows, prompt and outputs.
        assert request.status == RequestStatus.RUNNING, "only running requests can be preempted"
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)  # first in line to come back

    def _make_cached_request_data(self, running_reqs: list[Request], resumed_reqs: list[Request],
                                  req_to_new_block_ids: dict[str, list[int]]) -> CachedRequestData:
        # Lists parallel to req_ids: running ones first, then resumed ones (vLLM order).
        data = CachedRequestData.make_empty()
        for idx, req in enumerate(running_reqs + resumed_reqs):
            req_id = req.request_id
            data.req_ids.append(req_id)
            if idx >= len(running_reqs):
                data.resumed_req_ids.add(req_id)  # their new_block_ids replace the block table
            # vLLM sends all tokens of every request that sat out the previous step (a V1 runner reads them only
            # under async scheduling); new_token_ids stays [] without pipeline parallelism.
            if req_id not in self.prev_step_scheduled_req_ids:
                data.all_token_ids[req_id] = list(req.all_token_ids)
            block_ids = req_to_new_block_ids[req_id]
            data.new_block_ids.append((block_ids,) if block_ids else None)
            data.num_computed_tokens.append(req.num_computed_tokens)  # before this step's tokens
            data.num_output_tokens.append(req.num_output_tokens)
        return data

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # Advance num_computed_tokens now, as if the step had already run, so the next schedule() can plan ahead;
        # the output above was built with the values from before.
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        # Rebind rather than clear: the SchedulerOutput just built holds the old set.
        self.finished_req_ids = set()

    # -- update ------------------------------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Take in what the runner sampled for a scheduled step: append tokens, apply stop conditions, free
        finished requests, and return one EngineCoreOutput per request that produced tokens or finished."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = _LogprobsRows(model_runner_output.logprobs) if model_runner_output.logprobs is not None else None
        outputs: list[EngineCoreOutput] = []
        stopped_running: set[str] = set()
        stopped_waiting: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while the step ran
            req_index = model_runner_output.req_id_to_index[req_id]
            # A copy: trimming after a stop token must not rewrite the runner's output (it may be captured).
            new_token_ids = list(sampled_token_ids[req_index]) if sampled_token_ids else []
            status_before_stop = request.status
            stopped = False
            if new_token_ids:  # [] for a partial prefill chunk
                new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
            if stopped:
                self._free_request(request)
                (stopped_running if status_before_stop == RequestStatus.RUNNING else stopped_waiting).add(req_id)
            new_logprobs = None
            # vLLM's `num_logprobs`: a request that asked only `logprob_token_ids` gets its rows too
            if request.sampling_params.num_logprobs is not None and logprobs is not None:
                new_logprobs = logprobs.slice_request(req_index, len(new_token_ids))
            prompt_logprobs_tensors = model_runner_output.prompt_logprobs_dict.get(req_id)
            if new_token_ids or stopped:
                outputs.append(EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs_tensors=prompt_logprobs_tensors,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                ))
        if stopped_running:
            self.running = [r for r in self.running if r.request_id not in stopped_running]
        if stopped_waiting:
            self.waiting = deque(r for r in self.waiting if r.request_id not in stopped_waiting)
        finished = self.finished_req_ids_for_outputs
        self.finished_req_ids_for_outputs = set()
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(), finished_requests=finished or None)

    def _update_request_with_output(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        # Append token by token and stop at the first one that finishes the request; later ones are dropped.
        for num_new, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            if self._check_stop(request):
                return new_token_ids[:num_new], True
        return new_token_ids, False

    def _check_stop(self, request: Request) -> bool:
        # vLLM's check_stop, in its order: min_tokens gates everything, then eos, stop tokens, lengths.
        sp = request.sampling_params
        if request.num_output_tokens < sp.min_tokens:
            return False
        last_token_id = request.output_token_ids[-1]
        if not sp.ignore_eos and request.eos_token_id is not None and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in (sp.stop_token_ids or ()):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        if request.num_tokens >= self.max_model_len or (
                request.max_tokens is not None and request.num_output_tokens >= request.max_tokens):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: Request) -> None:
        # The caller has set a FINISHED_* status and takes the request out of running/waiting.
        assert request.is_finished()
        self.finished_req_ids.add(request.request_id)
        self.finished_req_ids_for_outputs.add(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]


class _LogprobsRows:
    """One step's `LogprobsLists` unpacked to numpy once, then sliced per request (vLLM's `slice_request`)."""

    def __init__(self, lists: LogprobsLists):
        self.token_ids = lists.logprob_token_ids.to_numpy()
        self.logprobs = lists.logprobs.to_numpy()
        self.ranks = lists.sampled_token_ranks.to_numpy()
        self.cu_num_generated_tokens = lists.cu_num_generated_tokens

    def slice_request(self, req_index: int, num_positions: int) -> LogprobsLists:
        """The rows of one request: `num_positions` rows from its first (rows are one per token without spec
        decode, else `cu_num_generated_tokens` gives each request's first row)."""
        start = self.cu_num_generated_tokens[req_index] if self.cu_num_generated_tokens is not None else req_index
        end = start + num_positions
        return LogprobsLists(_array(self.token_ids[start:end]), _array(self.logprobs[start:end]),
                             _array(self.ranks[start:end]))


def _array(a: np.ndarray) -> Array:
    return Array.from_numpy(np.ascontiguousarray(a))
