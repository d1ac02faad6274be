"""Converts steps between their in-memory form (string request ids, plain arrays) and the stored form.

Two lossless transforms, both undone exactly on read:
- request ids become int handles (`IdTable`), each id string stored once per capture in an `Ids` record;
- logprob matrices are byte-shuffled, and column 0 of `logprob_token_ids` (the sampled token, which repeats
  `sampled_token_ids`) is stored as its difference from the sampled token, so it compresses to almost nothing
  (docs/performance.md, "Capture format"). Since format 1.3 the writer hands
  a step's logprob matrices to its chunk's columns instead (`replay.capture.codec.columns`) and the step keeps markers;
  the per-step transforms remain for what the columns do not take and for earlier captures.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from operator import add
from typing import TypeVar

import numpy as np
from msgspec.structs import replace

from replay.capture.codec.columns import (
    FILTER_COL0_XOR,
    ColumnSink,
    ColumnSource,
    is_marker,
    small_ids,
    xor_col0_inplace,
)
from replay.capture.codec.columns import plain as _plain
from replay.capture.codec.passes import PASSES, PythonPasses
from replay.capture.format.ids import IdTable
from replay.capture.format.records import (
    COMPUTED_MINUS_OUTPUT,
    OUTPUT_IDS_IN_BATCH_ORDER,
    OUTPUT_INDEX_IN_ORDER,
    AlignedStep,
    PackedStep,
    Step,
)
from replay.contracts import (
    Array,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    SchedulerOutput,
)

A = TypeVar("A")
B = TypeVar("B")

# Filter names only this module can undo (they need other fields of the step):
FILTER_COL0 = "col0-minus-sampled"  # ids: column 0 holds (id - the row's sampled token)
# values: column 0 holds (bits XOR the bits of the first column j >= 1 with the same token id). The sampled token
# is usually also among the top-k (always the top-1 under greedy), and then both columns hold the very same
# log-softmax value, so the stored column becomes zeros. (Logprob columns use it too: `replay.capture.codec.columns`.)


# Mapping helpers: `map` with a C-level callable (a dict's __getitem__) keeps interning off the Python loop.
def _ml(f, xs):
    return list(map(f, xs)) if xs else xs


def _ms(f, xs):
    return set(map(f, xs)) if xs else xs


def _md(f, d):
    return dict(zip(map(f, d), d.values())) if d else d


def _map_so(so: SchedulerOutput, f: Callable[[A], B], cached: Callable | None = None,
            scheduled_left_out: bool = False, counts: tuple | None = None) -> SchedulerOutput:
    """`so` with its request ids mapped through `f` (`cached`: the cached requests' ids at once); writing, also
    `num_scheduled_tokens` stored empty (`scheduled_left_out`) and the cached requests' (computed - output, output)
    token counts (`counts`)."""
    cr = so.scheduled_cached_reqs
    if counts is not None or cr.req_ids or cr.resumed_req_ids or cr.all_token_ids:
        packed = {} if counts is None else {"num_computed_tokens": counts[0], "num_output_tokens": counts[1]}
        cr = replace(cr, req_ids=_ml(f, cr.req_ids) if cached is None else cached(cr.req_ids),
                     resumed_req_ids=_ms(f, cr.resumed_req_ids), all_token_ids=_md(f, cr.all_token_ids), **packed)
    new = so.scheduled_new_reqs
    if new:
        new = [replace(r, req_id=f(r.req_id)) for r in new]
    return replace(
        so,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cr,
        num_scheduled_tokens={} if scheduled_left_out else _md(f, so.num_scheduled_tokens),
        scheduled_spec_decode_tokens=_md(f, so.scheduled_spec_decode_tokens),
        scheduled_encoder_inputs=_md(f, so.scheduled_encoder_inputs),
        finished_req_ids=_ms(f, so.finished_req_ids),
        preempted_req_ids=None if so.preempted_req_ids is None else _ms(f, so.preempted_req_ids),
        num_invalid_spec_tokens=None if so.num_invalid_spec_tokens is None else _md(f, so.num_invalid_spec_tokens),
    )


def _map_connector(out, f):
    if out is None:
        return None
    return replace(
        out,
        finished_sending=None if out.finished_sending is None else _ms(f, out.finished_sending),
        finished_recving=None if out.finished_recving is None else _ms(f, out.finished_recving),
    )


def _map_mro(mro: ModelRunnerOutput, f: Callable[[A], B], lp: Callable, plp: Callable, req_ids: list | None = None,
             req_id_to_index: dict | None = None, sampled: object = None) -> ModelRunnerOutput:
    """`mro` with its request ids mapped through `f` and its logprobs through `lp`/`plp`; writing, `req_ids`,
    `req_id_to_index` (before mapping: stored empty where the batch order gives them back) and `sampled` (the sampled
    tokens as stored) in place of the output's own."""
    return replace(
        mro,
        req_ids=_ml(f, mro.req_ids if req_ids is None else req_ids),
        req_id_to_index=_md(f, mro.req_id_to_index if req_id_to_index is None else req_id_to_index),
        sampled_token_ids=mro.sampled_token_ids if sampled is None else sampled,
        logprobs=None if mro.logprobs is None else lp(mro.logprobs, mro.sampled_token_ids),
        prompt_logprobs_dict={f(k): (None if v is None else plp(v)) for k, v in mro.prompt_logprobs_dict.items()},
        prompt_token_id_logprobs_dict=_md(f, mro.prompt_token_id_logprobs_dict),
        kv_connector_output=_map_connector(mro.kv_connector_output, f),
        ec_connector_output=_map_connector(mro.ec_connector_output, f),
        num_nans_in_logits=None if mro.num_nans_in_logits is None else _md(f, mro.num_nans_in_logits),
        aux_output_connector_output=_md(f, mro.aux_output_connector_output) if isinstance(
            mro.aux_output_connector_output, dict) else mro.aux_output_connector_output,
    )


def _predicted_col0(n_rows: int, sampled: list[list[int]]) -> np.ndarray | None:
    """What column 0 should hold: the sampled token of each row, when rows line up with the sampled tokens.
    Rows of requests that sampled nothing (partial prefill) predict 0; they still hold a token in vLLM."""
    try:
        flat = list(chain.from_iterable(sampled))
        if len(flat) == n_rows:  # one row per sampled token (the common case, and spec decode)
            return np.array(flat, dtype=np.int64)
        if len(sampled) == n_rows and all(len(s) <= 1 for s in sampled):
            return np.fromiter((s[0] if s else 0 for s in sampled), dtype=np.int64, count=n_rows)
    except OverflowError:  # token ids beyond int64: no prediction, column 0 is stored as it is
        pass
    return None


def _with(a: Array, extra: str) -> Array:
    return replace(a, filters=a.filters + (extra,))


def _pack_lp(lp: LogprobsLists, sampled: list[list[int]]) -> LogprobsLists:
    """One step's logprobs packed on their own (a step written outside a chunk's columns)."""
    ids = _plain(lp.logprob_token_ids)
    vals = _plain(lp.logprobs)
    two_d = ids.ndim == 2 and ids.shape[1] >= 1
    xor_ok = two_d and vals.shape == ids.shape and ids.shape[1] >= 2 and vals.dtype.itemsize >= 2
    if xor_ok:
        vals = vals.copy()
        xor_col0_inplace(vals, ids)  # before column 0 of ids changes
    out_vals = Array.from_numpy(vals, shuffle=True, transpose=True)
    if xor_ok:
        out_vals = _with(out_vals, FILTER_COL0_XOR)
    pred = _predicted_col0(ids.shape[0], sampled) if two_d and ids.dtype.kind in "iu" else None
    if pred is not None:
        ids = ids.copy()
        ids[:, 0] = (ids[:, 0].astype(np.int64) - pred).astype(ids.dtype)  # wraps like C ints: reversible
        out_ids = _with(Array.from_numpy(ids, transpose=True, shuffle=small_ids(ids)), FILTER_COL0)
    else:
        out_ids = Array.from_numpy(ids, transpose=True, shuffle=small_ids(ids))
    return replace(lp, logprob_token_ids=out_ids, logprobs=out_vals,
                   sampled_token_ranks=Array.from_numpy(_plain(lp.sampled_token_ranks), shuffle=True))


def _without(a: Array, name: str) -> tuple[Array, bool]:
    if name not in a.filters:
        return a, False
    return replace(a, filters=tuple(x for x in a.filters if x != name)), True


def _unpack_lp(lp: LogprobsLists, sampled: list[list[int]], columns: ColumnSource | None = None) -> LogprobsLists:
    if is_marker(lp.logprob_token_ids):
        if columns is None:
            raise ValueError("the step's logprobs are in logprob columns its chunk does not have")
        return columns.fill(lp)
    ids_a, col0 = _without(lp.logprob_token_ids, FILTER_COL0)
    ids = ids_a.to_numpy()
    if col0:
        pred = _predicted_col0(ids.shape[0], sampled)
        if pred is None or ids.ndim != 2:
            raise ValueError("stored logprobs do not line up with the stored sampled tokens")
        ids[:, 0] = (ids[:, 0].astype(np.int64) + pred).astype(ids.dtype)
    vals_a, xor = _without(lp.logprobs, FILTER_COL0_XOR)
    vals = vals_a.to_numpy()
    if xor:
        if vals.shape != ids.shape or ids.ndim != 2:
            raise ValueError("stored logprob values do not line up with their token ids")
        xor_col0_inplace(vals, ids)
    return replace(lp, logprob_token_ids=Array.from_numpy(ids), logprobs=Array.from_numpy(vals),
                   sampled_token_ranks=_unpack_array(lp.sampled_token_ranks))


def _unpack_array(a: Array) -> Array:
    return Array.from_numpy(a.to_numpy()) if a.filters else a


def _pack_plp(t: LogprobsTensors) -> LogprobsTensors:
    return replace(
        t,
        logprob_token_ids=Array.from_numpy(_plain(t.logprob_token_ids), transpose=True),
        logprobs=Array.from_numpy(_plain(t.logprobs), shuffle=True, transpose=True),
        selected_token_ranks=Array.from_numpy(_plain(t.selected_token_ranks), shuffle=True),
    )


def _unpack_plp(t: LogprobsTensors) -> LogprobsTensors:
    return replace(
        t,
        logprob_token_ids=_unpack_array(t.logprob_token_ids),
        logprobs=_unpack_array(t.logprobs),
        selected_token_ranks=_unpack_array(t.selected_token_ranks),
    )


def _map_rest(step: Step, f: Callable) -> tuple:
    """The step's fields after its outputs (`drawn_seeds`, `rng_state`, `timing`, `grammar_output`), ids mapped."""
    go = step.grammar_output
    return (_md(f, step.drawn_seeds), step.rng_state, step.timing,
            None if go is None else replace(go, structured_output_request_ids=_ml(f, go.structured_output_request_ids)))


def _map_step(step: Step, f: Callable, lp: Callable, plp: Callable) -> Step:
    mro = step.model_runner_output
    seeds, _, _, go = _map_rest(step, f)
    return replace(step, scheduler_output=_map_so(step.scheduler_output, f),
                   model_runner_output=None if mro is None else _map_mro(mro, f, lp, plp),
                   drawn_seeds=seeds, grammar_output=go)


def map_request_ids(step: Step[A], f: Callable[[A], B]) -> Step[B]:
    """The step with every request id mapped through `f`, arrays as they are."""
    return _map_step(step, f, lambda lp, sampled: lp, lambda t: t)


def batch_order(so: SchedulerOutput[A]) -> list[A]:
    """The step's batch order: `scheduled_cached_reqs.req_ids`, then the new requests' ids (the order our engine and
    vLLM's scheduler fill `num_scheduled_tokens` in, and that the runner's output follows)."""
    cached = so.scheduled_cached_reqs.req_ids
    return cached + [r.req_id for r in so.scheduled_new_reqs] if so.scheduled_new_reqs else list(cached)


def _slim(so: SchedulerOutput[str], mro: ModelRunnerOutput[str] | None,
          p: PythonPasses) -> tuple[list[int] | None, int, list | None, dict | None]:
    """What of the step its batch order gives back (`AlignedStep`): the values of `num_scheduled_tokens` if the map
    is left out, the elided bits, and the output's `req_ids` and `req_id_to_index` as stored ([] and {} where left
    out, None where kept). Checked on the string ids, before interning, so the maps left out are never remapped:
    list comparisons run at C speed, dict building does not."""
    cached = so.scheduled_cached_reqs.req_ids
    order = cached if not so.scheduled_new_reqs and type(cached) is list else batch_order(so)  # (only read)
    scheduled = p.ordered_values(so.num_scheduled_tokens, order)  # (keys are distinct, so `order` has no repeats)
    elided = 0
    ids = index = None
    if mro is not None:
        if mro.req_ids == order:
            elided |= OUTPUT_IDS_IN_BATCH_ORDER
            ids = []
        if p.is_index(mro.req_id_to_index, mro.req_ids):
            elided |= OUTPUT_INDEX_IN_ORDER
            index = {}
    return scheduled, elided, ids, index


def _unpacked(step: Step[int]) -> Step[int]:
    if isinstance(step, AlignedStep):
        return _unaligned(step)
    if not isinstance(step, PackedStep):
        return step
    return Step(step.index, _computed_restored(step.scheduler_output), *(getattr(step, f) for f in _STEP_FIELDS[2:]))


def _computed_restored(so: SchedulerOutput[int]) -> SchedulerOutput[int]:
    """The scheduler output with its computed-token counts, stored against the output-token counts, added back."""
    cr = so.scheduled_cached_reqs
    if len(cr.num_computed_tokens) != len(cr.num_output_tokens):
        raise ValueError("a packed step's computed- and output-token counts differ in length")
    return replace(so, scheduled_cached_reqs=replace(
        cr, num_computed_tokens=list(map(add, cr.num_computed_tokens, cr.num_output_tokens))))


def _unaligned(step: AlignedStep) -> Step[int]:
    """The `Step` an `AlignedStep` was made from (handles as stored). Raises ValueError where the parts left out
    cannot have been what the batch order gives back."""
    so, mro, elided = step.scheduler_output, step.model_runner_output, step.elided
    if elided & COMPUTED_MINUS_OUTPUT:
        so = _computed_restored(so)
    order = batch_order(so)
    if step.num_scheduled is not None:
        if len(step.num_scheduled) != len(order) or so.num_scheduled_tokens:
            raise ValueError("a step's scheduled-token counts do not line up with its batch")
        so = replace(so, num_scheduled_tokens=dict(zip(order, step.num_scheduled)))
    if elided & (OUTPUT_IDS_IN_BATCH_ORDER | OUTPUT_INDEX_IN_ORDER):
        if mro is None or (elided & OUTPUT_IDS_IN_BATCH_ORDER and mro.req_ids) or \
                (elided & OUTPUT_INDEX_IN_ORDER and mro.req_id_to_index):
            raise ValueError("a step's output request ids are both stored and left out")
        ids = order if elided & OUTPUT_IDS_IN_BATCH_ORDER else mro.req_ids
        mro = replace(mro, req_ids=ids, req_id_to_index=dict(zip(ids, range(len(ids))))
                      if elided & OUTPUT_INDEX_IN_ORDER else mro.req_id_to_index)
    return Step(step.index, so, mro, *(getattr(step, f) for f in _STEP_FIELDS[3:]))


_STEP_FIELDS = Step.__struct_fields__  # index, scheduler_output, then the rest


def step_to_wire(step: Step[str], table: IdTable, columns: ColumnSink | None = None) -> Step[int]:
    """The stored form of a step (an `AlignedStep` where it can be); new ids are assigned handles in `table` (collect
    them with `take_new`). With `columns` (the open chunk's), its logprob matrices go there and the step keeps
    markers to them."""
    return _to_wire(step, table, columns, PASSES)[0]


def stored_step(step: Step[str], table: IdTable, columns: ColumnSink | None = None) -> tuple[Step[int], int]:
    """`step_to_wire`, and the step's count of generated tokens (the writer's)."""
    return _to_wire(step, table, columns, PASSES)


def _to_wire(step: Step[str], table: IdTable, columns: ColumnSink | None, p: PythonPasses) -> tuple[Step[int], int]:
    so, mro = step.scheduler_output, step.model_runner_output
    # the pure passes first, then what interns
    tokens, generated = p.tokens(mro.sampled_token_ids) if mro is not None else (None, 0)
    scheduled, elided, out_ids, out_index = _slim(so, mro, p)
    cr = so.scheduled_cached_reqs
    done, out = cr.num_computed_tokens, cr.num_output_tokens
    counts = None
    if done and len(done) == len(out):  # stored against the output-token counts (`PackedStep`)
        counts = (p.minus(done, out), p.ints(out))
        elided |= COMPUTED_MINUS_OUTPUT
    if columns is None:
        pack = _pack_lp
    else:
        def pack(lp: LogprobsLists, sampled: list[list[int]]) -> LogprobsLists:
            return columns.add(lp) or _pack_lp(lp, sampled)
    f = table.handle
    # then what interns and what moves logprobs into `columns`, each part built once
    wso = _map_so(so, f, lambda ids: p.handles(ids, f, table.interning), scheduled is not None, counts)
    wmro = None if mro is None else _map_mro(mro, f, pack, _pack_plp, out_ids, out_index, tokens)
    rest = _map_rest(step, f)
    if scheduled is None and not elided:
        return Step(step.index, wso, wmro, *rest), generated
    return AlignedStep(step.index, wso, wmro, *rest, scheduled, elided), generated


def step_from_wire(step: Step[int], table: IdTable, columns: ColumnSource | None = None) -> Step[str]:
    """The in-memory form of a stored step (`columns`: its chunk's logprob columns, if it has them). Raises
    UnknownHandleError, or ValueError on inconsistent arrays."""
    step = _unpacked(step)
    if columns is None:
        return _map_step(step, table.resolve, _unpack_lp, _unpack_plp)
    return _map_step(step, table.resolve, lambda lp, sampled: _unpack_lp(lp, sampled, columns), _unpack_plp)
