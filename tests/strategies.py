"""Hypothesis strategies that build any valid contract value (used by the round-trip property tests)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from replay.capture.format.records import StepTiming
from replay.contracts import (
    Array,
    CachedRequestData,
    EngineCoreRequest,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    NewRequestData,
    Opaque,
    SamplingParams,
    SchedulerOutput,
)

req_ids = st.text(min_size=1, max_size=16)
tokens = st.integers(0, 2**31 - 1)
token_lists = st.lists(tokens, max_size=8)
small_ints = st.integers(0, 10_000)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)

_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int32": np.int32, "int64": np.int64,
           "uint8": np.uint8, "bool": np.bool_}


@st.composite
def arrays(draw, dtype=None, shape=None):
    """An Array of any stored dtype, NaN/inf/-0.0 included: round trips must keep every bit."""
    name = dtype or draw(st.sampled_from(sorted(_DTYPES)))
    shp = shape if shape is not None else draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5))
    arr = draw(hnp.arrays(_DTYPES[name], shp))
    return Array.from_numpy(arr)


sampling_params = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop=st.none() | st.lists(st.text(max_size=4), max_size=2),
    stop_token_ids=st.none() | token_lists,
    ignore_eos=st.booleans(),
    max_tokens=st.none() | st.integers(1, 4096),
    logprobs=st.none() | st.integers(-1, 20),
    prompt_logprobs=st.none() | st.integers(-1, 20),
    logit_bias=st.none() | st.dictionaries(tokens, finite, max_size=3),
    extra_args=st.none() | st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
                                           max_size=2),
)

opaques = st.builds(Opaque, type=st.text(min_size=1, max_size=20), size=st.none() | small_ints,
                    summary=st.text(max_size=30))


@st.composite
def scheduler_outputs(draw):
    """A SchedulerOutput whose id-keyed fields name a consistent set of requests."""
    ids = draw(st.lists(req_ids, unique=True, max_size=8))
    k = draw(st.integers(0, len(ids)))
    new_ids, cached = ids[:k], ids[k:]
    new = [
        NewRequestData(
            rid, draw(st.none() | token_lists), draw(st.lists(opaques, max_size=1)), draw(st.none() | sampling_params),
            None, tuple(draw(st.lists(st.lists(small_ints, max_size=4), min_size=1, max_size=2))), draw(small_ints),
            draw(st.none() | opaques), prompt_embeds=draw(st.none() | arrays("float32", (2, 3))),
        )
        for rid in new_ids
    ]
    cr = CachedRequestData(
        list(cached),
        set(draw(st.lists(st.sampled_from(cached), max_size=3))) if cached else set(),
        [draw(token_lists) for _ in cached] if draw(st.booleans()) else [],
        {rid: draw(token_lists) for rid in cached[:1]},
        [draw(st.none() | st.tuples(st.lists(small_ints, max_size=3))) for _ in cached],
        [draw(small_ints) for _ in cached],
        [draw(small_ints) for _ in cached],
    )
    sched = {rid: draw(st.integers(1, 64)) for rid in ids}
    finished = set(draw(st.lists(req_ids, max_size=3)))
    return SchedulerOutput(
        new, cr, sched, sum(sched.values()),
        {rid: draw(token_lists) for rid in ids[:1]},
        {rid: [0] for rid in ids[1:2]},
        finished,
        draw(st.lists(st.text(max_size=8), max_size=2)),
        preempted_req_ids=draw(st.none() | st.just(set(ids[:1]))),
        num_invalid_spec_tokens=draw(st.none() | st.just({rid: 1 for rid in ids[:1]})),
        kv_connector_metadata=draw(st.none() | opaques),
        num_common_prefix_blocks=draw(st.lists(small_ints, max_size=2)),
    )


@st.composite
def logprobs_lists(draw, rows: int, aligned_tokens: list[list[int]] | None):
    """LogprobsLists with `rows` rows; column 0 repeats the sampled token when `aligned_tokens` is given."""
    k = draw(st.integers(1, 4))
    ids = draw(hnp.arrays(np.int32, (rows, k), elements=st.integers(0, 2**31 - 1)))
    if aligned_tokens is not None:
        for i, t in enumerate(aligned_tokens):
            if t:
                ids[i, 0] = t[0]
                if k > 1 and draw(st.booleans()):
                    ids[i, 1] = t[0]  # greedy: the sampled token is also the top-1
    vals = draw(hnp.arrays(np.float32, (rows, k)))
    if k > 1 and rows and draw(st.booleans()):
        same = ids[:, 1] == ids[:, 0]
        vals[same, 0] = vals[same, 1]
    ranks = draw(hnp.arrays(np.int64, (rows,)))
    cu = draw(st.none() | st.lists(small_ints, min_size=1, max_size=3))
    return LogprobsLists(Array.from_numpy(ids), Array.from_numpy(vals), Array.from_numpy(ranks), cu)


@st.composite
def model_runner_outputs(draw):
    """A ModelRunnerOutput with consistent ids, sometimes with logprob rows that do not line up."""
    ids = draw(st.lists(req_ids, unique=True, max_size=8))
    sampled = [draw(st.lists(tokens, max_size=2)) for _ in ids]
    aligned = draw(st.booleans())
    rows = len(ids) if aligned else draw(st.integers(0, 6))
    lp = draw(st.none() | logprobs_lists(rows, sampled if aligned else None))
    plp = {
        rid: draw(st.none() | st.builds(LogprobsTensors, arrays("int32", (3, 2)), arrays("float32", (3, 2)),
                                        arrays("int32", (3,))))
        for rid in ids[:2]
    }
    kv = draw(st.none() | st.builds(KVConnectorOutput, finished_sending=st.none() | st.just(set(ids[:1])),
                                    invalid_block_ids=st.sets(small_ints, max_size=2)))
    return ModelRunnerOutput(
        ids, {rid: i for i, rid in enumerate(ids)}, sampled, lp, plp,
        {rid: draw(arrays("float32", (1, 2))) for rid in ids[:1]},
        draw(st.none() | st.lists(st.none() | arrays("float32", (4,)), max_size=2)),
        kv,
        num_nans_in_logits=draw(st.none() | st.just({rid: 0 for rid in ids})),
    )


engine_core_requests = st.builds(
    EngineCoreRequest,
    request_id=req_ids,
    prompt_token_ids=st.none() | token_lists,
    mm_features=st.none() | st.lists(opaques, max_size=1),
    sampling_params=st.none() | sampling_params,
    pooling_params=st.none() | opaques,
    arrival_time=finite,
    lora_request=st.none() | opaques,
    cache_salt=st.none() | st.text(max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 8),
    prompt_embeds=st.none() | arrays("float32", (2, 2)),
    priority=st.integers(-5, 5),
    external_req_id=st.none() | req_ids,
)

step_timings = st.builds(StepTiming, small_ints, small_ints, small_ints, small_ints)
