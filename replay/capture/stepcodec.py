"""Converts steps between their in-memory form (string request ids, plain arrays) and the stored form.

Two lossless transforms, both undone exactly on read:
- request ids become int handles (`IdTable`), each id string stored once per capture in an `Ids` record;
- logprob matrices are byte-shuffled, and column 0 of `logprob_token_ids` (the sampled token, which repeats
  `sampled_token_ids`) is stored as its difference from the sampled token, so it compresses to almost nothing
  (measurements §2: 40.4 -> 34.8 B per generated token with top-5 logprobs).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
from msgspec.structs import replace

from replay.contracts import Array, LogprobsLists, LogprobsTensors, ModelRunnerOutput, SchedulerOutput
from replay.capture.format import Ids, Step

A = TypeVar("A")
B = TypeVar("B")

# Filter names only this module can undo (they need other fields of the step):
FILTER_COL0 = "col0-minus-sampled"  # ids: column 0 holds (id - the row's sampled token)
# values: column 0 holds (bits XOR the bits of the first column j >= 1 with the same token id). The sampled token
# is usually also among the top-k (always the top-1 under greedy), and then both columns hold the very same
# log-softmax value, so the stored column becomes zeros.
FILTER_COL0_XOR = "col0-xor-same-token"


class UnknownHandleError(KeyError):
    """A stored step refers to a request-id handle whose `Ids` record was never read (it sat in a lost chunk)."""


class IdTable:
    """Request id <-> handle, handles given in order of first appearance."""

    def __init__(self, ids: list[str] | None = None):
        self.ids: list[str | None] = list(ids or [])
        self._handles: dict[str, int] = {s: i for i, s in enumerate(self.ids) if s is not None}
        self._pending_first = len(self.ids)

    def handle(self, req_id: str) -> int:
        """The handle of `req_id`, assigning the next one if it is new."""
        h = self._handles.get(req_id)
        if h is None:
            h = self._handles[req_id] = len(self.ids)
            self.ids.append(req_id)
        return h

    def take_new(self) -> Ids | None:
        """An `Ids` record declaring every handle assigned since the last call, or None."""
        first = self._pending_first
        if first == len(self.ids):
            return None
        self._pending_first = len(self.ids)
        return Ids(first, [s for s in self.ids[first:]])  # type: ignore[misc]

    def declare(self, rec: Ids) -> None:
        """Learn the handles an `Ids` record declares (reader side). Gaps from lost chunks stay unknown."""
        end = rec.first + len(rec.ids)
        if end > len(self.ids):
            self.ids.extend([None] * (end - len(self.ids)))
        for i, s in enumerate(rec.ids, rec.first):
            self.ids[i] = s
            self._handles[s] = i
        self._pending_first = len(self.ids)

    def resolve(self, h: int) -> str:
        """The id string of handle `h`; UnknownHandleError if it was never declared."""
        s = self.ids[h] if 0 <= h < len(self.ids) else None
        if s is None:
            raise UnknownHandleError(h)
        return s


def _map_so(so: SchedulerOutput, f: Callable[[A], B]) -> SchedulerOutput:
    cr = so.scheduled_cached_reqs
    return replace(
        so,
        scheduled_new_reqs=[replace(r, req_id=f(r.req_id)) for r in so.scheduled_new_reqs],
        scheduled_cached_reqs=replace(
            cr,
            req_ids=[f(x) for x in cr.req_ids],
            resumed_req_ids={f(x) for x in cr.resumed_req_ids},
            all_token_ids={f(k): v for k, v in cr.all_token_ids.items()},
        ),
        num_scheduled_tokens={f(k): v for k, v in so.num_scheduled_tokens.items()},
        scheduled_spec_decode_tokens={f(k): v for k, v in so.scheduled_spec_decode_tokens.items()},
        scheduled_encoder_inputs={f(k): v for k, v in so.scheduled_encoder_inputs.items()},
        finished_req_ids={f(x) for x in so.finished_req_ids},
        preempted_req_ids=None if so.preempted_req_ids is None else {f(x) for x in so.preempted_req_ids},
        num_invalid_spec_tokens=None
        if so.num_invalid_spec_tokens is None
        else {f(k): v for k, v in so.num_invalid_spec_tokens.items()},
    )


def _map_mro(mro: ModelRunnerOutput, f: Callable[[A], B], lp: Callable, plp: Callable) -> ModelRunnerOutput:
    kv = mro.kv_connector_output
    if kv is not None:
        kv = replace(
            kv,
            finished_sending=None if kv.finished_sending is None else {f(x) for x in kv.finished_sending},
            finished_recving=None if kv.finished_recving is None else {f(x) for x in kv.finished_recving},
        )
    ec = mro.ec_connector_output
    if ec is not None:
        ec = replace(
            ec,
            finished_sending=None if ec.finished_sending is None else {f(x) for x in ec.finished_sending},
            finished_recving=None if ec.finished_recving is None else {f(x) for x in ec.finished_recving},
        )
    return replace(
        mro,
        req_ids=[f(x) for x in mro.req_ids],
        req_id_to_index={f(k): v for k, v in mro.req_id_to_index.items()},
        logprobs=None if mro.logprobs is None else lp(mro.logprobs, mro.sampled_token_ids),
        prompt_logprobs_dict={f(k): (None if v is None else plp(v)) for k, v in mro.prompt_logprobs_dict.items()},
        prompt_token_id_logprobs_dict={f(k): v for k, v in mro.prompt_token_id_logprobs_dict.items()},
        kv_connector_output=kv,
        ec_connector_output=ec,
        num_nans_in_logits=None if mro.num_nans_in_logits is None else {f(k): v for k, v in mro.num_nans_in_logits.items()},
    )


def _predicted_col0(n_rows: int, sampled: list[list[int]]) -> np.ndarray | None:
    """What column 0 should hold: the sampled token of each row, when rows line up with the sampled tokens.
    Rows of requests that sampled nothing (partial prefill) predict 0; they still hold a token in vLLM."""
    if len(sampled) == n_rows and all(len(s) <= 1 for s in sampled):
        return np.fromiter((s[0] if s else 0 for s in sampled), dtype=np.int64, count=n_rows)
    flat = [t for s in sampled for t in s]
    if len(flat) == n_rows:
        return np.asarray(flat, dtype=np.int64)
    return None


def _pack_lp(lp: LogprobsLists, sampled: list[list[int]]) -> LogprobsLists:
    ids = lp.logprob_token_ids
    out_ids = Array.from_numpy(ids.to_numpy(), transpose=True)
    if len(ids.shape) == 2 and ids.shape[1] >= 1 and ids.dtype.startswith("int"):
        pred = _predicted_col0(ids.shape[0], sampled)
        if pred is not None:
            arr = ids.to_numpy()
            arr[:, 0] = (arr[:, 0].astype(np.int64) - pred).astype(arr.dtype)  # wraps like C ints: reversible
            out_ids = Array.from_numpy(arr, transpose=True)
            out_ids = replace(out_ids, filters=out_ids.filters + (FILTER_COL0,))
    return replace(
        lp,
        logprob_token_ids=out_ids,
        logprobs=_pack_col0_values(lp.logprobs, ids),
        sampled_token_ranks=Array.from_numpy(lp.sampled_token_ranks.to_numpy(), shuffle=True),
    )


def _unpack_array(a: Array) -> Array:
    return Array.from_numpy(a.to_numpy()) if a.filters else a


def _unpack_lp(lp: LogprobsLists, sampled: list[list[int]]) -> LogprobsLists:
    ids = lp.logprob_token_ids
    if FILTER_COL0 in ids.filters:
        arr = replace(ids, filters=tuple(x for x in ids.filters if x != FILTER_COL0)).to_numpy()
        pred = _predicted_col0(arr.shape[0], sampled)
        if pred is None:
            raise ValueError("stored logprobs do not line up with the stored sampled tokens")
        arr[:, 0] = (arr[:, 0].astype(np.int64) + pred).astype(arr.dtype)
        ids = Array.from_numpy(arr)
    else:
        ids = _unpack_array(ids)
    values = lp.logprobs
    if FILTER_COL0_XOR in values.filters:
        values = _xor_col0(replace(values, filters=tuple(x for x in values.filters if x != FILTER_COL0_XOR)), ids)
    else:
        values = _unpack_array(values)
    return replace(lp, logprob_token_ids=ids, logprobs=values, sampled_token_ranks=_unpack_array(lp.sampled_token_ranks))


def _same_token_column(ids: np.ndarray) -> np.ndarray:
    """Per row, the first column j >= 1 whose id equals column 0's, or 0 when there is none."""
    match = ids[:, 1:] == ids[:, :1]
    return np.where(match.any(axis=1), match.argmax(axis=1) + 1, 0)


def _xor_col0(values: Array, ids: Array) -> Array:
    """XOR column 0's bits with those of its same-token column (an involution: packs and unpacks)."""
    v = values.to_numpy()
    bits = v.view(np.dtype(f"<u{v.dtype.itemsize}"))
    j = _same_token_column(ids.to_numpy())
    rows = np.nonzero(j)[0]
    bits[rows, 0] ^= bits[rows, j[rows]]
    return Array.from_numpy(v)


def _pack_col0_values(values: Array, ids: Array) -> Array:
    if len(values.shape) != 2 or tuple(values.shape) != tuple(ids.shape) or values.shape[1] < 2 or values.itemsize < 2:
        return Array.from_numpy(values.to_numpy(), shuffle=True, transpose=True)
    packed = Array.from_numpy(_xor_col0(values, ids).to_numpy(), shuffle=True, transpose=True)
    return replace(packed, filters=packed.filters + (FILTER_COL0_XOR,))


def _pack_plp(t: LogprobsTensors) -> LogprobsTensors:
    return replace(
        t,
        logprob_token_ids=Array.from_numpy(t.logprob_token_ids.to_numpy(), transpose=True),
        logprobs=Array.from_numpy(t.logprobs.to_numpy(), shuffle=True, transpose=True),
        selected_token_ranks=Array.from_numpy(t.selected_token_ranks.to_numpy(), shuffle=True),
    )


def _unpack_plp(t: LogprobsTensors) -> LogprobsTensors:
    return replace(
        t,
        logprob_token_ids=_unpack_array(t.logprob_token_ids),
        logprobs=_unpack_array(t.logprobs),
        selected_token_ranks=_unpack_array(t.selected_token_ranks),
    )


def _map_step(step: Step, f: Callable, lp: Callable, plp: Callable) -> Step:
    go = step.grammar_output
    return replace(
        step,
        scheduler_output=_map_so(step.scheduler_output, f),
        model_runner_output=None if step.model_runner_output is None else _map_mro(step.model_runner_output, f, lp, plp),
        drawn_seeds={f(k): v for k, v in step.drawn_seeds.items()},
        grammar_output=None if go is None else replace(go, structured_output_request_ids=[f(x) for x in go.structured_output_request_ids]),
    )


def step_to_wire(step: Step[str], table: IdTable) -> Step[int]:
    """The stored form of a step; new ids are assigned handles in `table` (collect them with `take_new`)."""
    return _map_step(step, table.handle, _pack_lp, _pack_plp)


def step_from_wire(step: Step[int], table: IdTable) -> Step[str]:
    """The in-memory form of a stored step. Raises UnknownHandleError, or ValueError on inconsistent arrays."""
    return _map_step(step, table.resolve, _unpack_lp, _unpack_plp)
