"""Property: any valid contract value written through a capture comes back bit for bit."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.capture import (
    CaptureReader,
    CaptureWriter,
    RequestAborted,
    RequestAdded,
    Step,
)
from replay.provenance import make_header
from tests.strategies import (
    engine_core_requests,
    model_runner_outputs,
    scheduler_outputs,
    step_timings,
)

_counter = itertools.count()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    steps=st.lists(st.tuples(scheduler_outputs(), st.none() | model_runner_outputs(), st.none() | step_timings,
                             st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 2**63 - 1), max_size=2)),
                   min_size=1, max_size=5),
    requests=st.lists(engine_core_requests, max_size=3),
    chunk_bytes=st.integers(64, 4096),
)
def test_any_step_round_trips_bit_exactly(tmp_path, steps, requests, chunk_bytes):
    path = tmp_path / f"rt{next(_counter)}.capture"
    written = []
    with CaptureWriter(path, make_header("test"), chunk_bytes=chunk_bytes) as w:
        for i, req in enumerate(requests):
            w.add_request(req, step=i)
            written.append(RequestAdded(i, req))
        for i, (so, mro, timing, seeds) in enumerate(steps):
            w.write_step(i, so, mro, timing=timing, drawn_seeds=seeds)
            written.append(Step(i, so, mro, drawn_seeds=seeds, timing=timing))
        w.abort_request("gone", step=len(steps))
        written.append(RequestAborted(len(steps), "gone"))
    with CaptureReader(path) as r:
        got = [rec for rec in r.records() if isinstance(rec, (Step, RequestAdded, RequestAborted))]
        assert r.damage == []
    assert got == written
    # random access through the index gives the same objects
    with CaptureReader(path) as r:
        for i in range(len(steps)):
            assert r.step(i) == written[len(requests) + i]
