"""Fuzzing the reader and every read command with mutated and random captures (hypothesis).

Time-boxed in CI (REPLAY_FUZZ_EXAMPLES, default 1,500 mutated files plus 500 random ones, ~15 s); run longer on demand:
    REPLAY_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_fuzz.py -s
Only the package's own error type may escape; a crafted frame claiming gigabytes is refused (test_capture_reader);
nothing is ever executed (no pickle: test_faults).
"""

from __future__ import annotations

import io
import os
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.capture import CaptureReader, StepRange
from replay.capture.format import records as fmt
from replay.capture.reading.recover import recover
from replay.errors import ReplayError
from replay.inspect import capture_info, export_records, show_steps
from replay.record.synth import SynthShape, record_synth

EXAMPLES = int(os.environ.get("REPLAY_FUZZ_EXAMPLES", "1500"))
_tried = {"inputs": 0}

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 7)),
    st.tuples(st.just("set"), st.floats(0, 1), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 64)),
    st.tuples(st.just("duplicate"), st.floats(0, 1), st.integers(1, 200)),
)


def _base(tmp_path_factory, index: bool) -> bytes:
    d = tmp_path_factory.mktemp("fuzzbase")
    path = record_synth(d / "b.capture", SynthShape(steps=12, running=3, prompt_len=(2, 10), output_len=(2, 8),
                                                      num_logprobs=2, vocab_size=300, seed=4), chunk_bytes=600)
    data = path.read_bytes()
    if not index:
        data = data[: struct.unpack_from("<Q", data, len(data) - 16)[0]]
    return data


def _mutate(data: bytes, muts) -> bytes:
    b = bytearray(data)
    for kind, where, arg in muts:
        pos = min(int(where * len(b)), max(len(b) - 1, 0))
        if kind == "flip" and b:
            b[pos] ^= 1 << arg
        elif kind == "set" and b:
            b[pos] = arg
        elif kind == "truncate":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = arg
        elif kind == "delete":
            del b[pos:pos + arg]
        elif kind == "duplicate":
            b[pos:pos] = b[pos:pos + arg]
    return bytes(b)


def _exercise(path, tmp) -> None:
    """Every read path; only ReplayError may come out."""
    for action in (
        lambda: list(CaptureReader(path).records()),
        lambda: capture_info(path),
        lambda: show_steps(path, StepRange(0, None)),
        lambda: show_steps(path, StepRange(3, 3)),
        lambda: export_records(path, io.StringIO()),
        lambda: recover(path, tmp / "rec.capture", force=True),
    ):
        try:
            action()
        except ReplayError:
            pass


def test_fuzz_mutated_captures(tmp_path_factory):
    bases = [_base(tmp_path_factory, True), _base(tmp_path_factory, False)]
    work = tmp_path_factory.mktemp("fuzz")

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(which=st.integers(0, 1), muts=st.lists(_mutation, min_size=1, max_size=4))
    def run(which, muts):
        p = work / "m.capture"
        p.write_bytes(_mutate(bases[which], muts))
        _tried["inputs"] += 1
        _exercise(p, work)

    run()
    print(f"fuzz: {_tried['inputs']} mutated captures, no foreign exception")


def test_fuzz_random_bytes_behind_a_valid_prologue(tmp_path):
    prologue = b"\x5e\x2a\x4d\x18" + struct.pack("<I", 12) + fmt.PROLOGUE_ID + struct.pack("<HH", 1, 0)

    @settings(max_examples=max(EXAMPLES // 3, 50), deadline=None, database=None)
    @given(body=st.binary(max_size=600), zstd=st.booleans())
    def run(body, zstd):
        p = tmp_path / "r.capture"
        p.write_bytes(prologue + (b"\x28\xb5\x2f\xfd" if zstd else b"") + body)
        _tried["inputs"] += 1
        _exercise(p, tmp_path)

    run()
