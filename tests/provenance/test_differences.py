"""header_differences: one list of what differs between two headers, in one order, with one label per field;
`replay run` and `replay diff` both read it."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from replay.capture import CaptureReader
from replay.capture.format.records import EngineConfig, Environment, ModelIdentity
from replay.provenance import hardware_differences, header_differences, make_header, set_torch_threads
from replay.replayer import build_runner

GOLDEN = Path(__file__).resolve().parents[2] / "captures" / "tiny-mixed.capture"


def _header(**changes):
    h = make_header("builtin", engine_version="1",
                    model=ModelIdentity("tiny", "LlamaForCausalLM", "ab" * 32, "float32"),
                    engine_config=EngineConfig(block_size=16, attention_impl="sdpa"),
                    environment=Environment(device="cpu", torch_version="2.13.0", num_threads=2, platform="Linux-x"))
    for path, value in changes.items():
        section, _, name = path.rpartition(".")
        target = getattr(h, section) if section else h
        setattr(target, name, value)
    return h


def test_identical_headers_have_no_differences():
    assert header_differences(_header(), _header()) == []


def test_differences_come_in_one_order_with_labels_and_what_they_affect():
    a = _header()
    b = _header(**{"engine_config.block_size": 32, "environment.num_threads": 1, "model.dtype": "bfloat16",
                   "environment.platform": "Linux-y"})
    diffs = header_differences(a, b)
    assert [(d.label, d.a, d.b, d.affects) for d in diffs] == [
        ("dtype", "float32", "bfloat16", "numerics"), ("threads", "2", "1", "numerics"),
        ("platform", "Linux-x", "Linux-y", "host"), ("block size", "16", "32", "scheduling")]
    assert diffs[0].as_note() == "dtype: recorded float32, replay bfloat16"
    assert diffs[0].as_pair() == "dtype: float32 vs bfloat16"


def test_another_engine_names_each_ones_version_and_no_version_difference():
    vllm = _header(engine="vllm", engine_version="0.32.0")
    notes = [d.as_note() for d in header_differences(vllm, _header())]
    assert notes == ["engine: recorded vllm 0.32.0, replay builtin 1"]
    upgraded = header_differences(vllm, _header(engine="vllm", engine_version="0.33.0"))
    assert [d.as_note() for d in upgraded] == ["engine version: recorded 0.32.0, replay 0.33.0"]


def test_an_unknown_fingerprint_or_a_missing_model_is_not_a_difference():
    assert header_differences(_header(), _header(**{"model.fingerprint": ""})) == []
    no_model = _header()
    no_model.model = None
    assert header_differences(_header(), no_model) == []
    changed = header_differences(_header(), _header(**{"model.fingerprint": "cd" * 32}))
    assert [(d.label, d.a, d.b) for d in changed] == [("fingerprint", "ab" * 6, "cd" * 6)]


def test_a_builtin_replay_describes_itself_as_its_recording_did():
    """The recorder and the replay build their headers with the same function: nothing differs as recorded."""
    with CaptureReader(GOLDEN) as r:
        header = r.header
    host = dict(os.environ)  # before the replay sets anything
    built = build_runner(header, {})
    # the golden capture may come from another processor (its kernel ISA, `cpu_capability`, differs then), torch
    # build or host environment (one machine of this kind sets OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE for every
    # process): what the replay itself chose must match
    hardware = hardware_differences(built.differences)
    host_env = [d for d in built.differences if d.field.startswith("environment.env.")
                and host.get(d.label) != header.environment.env.get(d.label)]
    numerics = [d for d in built.differences if d.affects in ("numerics", "model") and d not in hardware + host_env]
    assert [d.label for d in numerics if d.label not in ("torch", "cuda")] == []
    assert msgspec.structs.asdict(built.header.engine_config) == msgspec.structs.asdict(header.engine_config)
    import torch

    threads = torch.get_num_threads()
    try:
        overridden = build_runner(header, {"dtype": "bfloat16", "threads": "2"})
    finally:
        set_torch_threads(threads)
    assert [d.as_note() for d in overridden.differences if d.label in ("dtype", "threads")] == [
        "dtype: recorded float32, replay bfloat16", "threads: recorded 1, replay 2"]


def test_layout_differences_follow_hardware_and_lead_the_numerics():
    """vLLM's parallel layout and compilation settings, by vLLM's names; a setting only one side has (the builtin
    engine has no compilation mode) is unknown, not different."""
    vllm_side = {"tensor_parallel_size": "2", "pipeline_parallel_size": "1", "compilation_mode": "VLLM_COMPILE"}
    builtin_side = {"tensor_parallel_size": "1", "pipeline_parallel_size": "1"}
    diffs = header_differences(_header(**{"engine_config.layout": vllm_side}),
                               _header(**{"engine_config.layout": builtin_side, "model.dtype": "bfloat16"}))
    assert [(d.label, d.a, d.b, d.affects) for d in diffs] == [
        ("tensor_parallel_size", "2", "1", "layout"), ("dtype", "float32", "bfloat16", "numerics")]


def test_a_vllm_flag_recorded_only_when_on_is_off_where_another_vllm_layout_leaves_it_out():
    """`use_fp64_gumbel` and `enable_return_routed_experts` enter a vLLM layout only when on: against another vLLM
    layout without them they were off (a difference: the first changes the sampler, the second only what is
    returned), against the builtin engine's layout they are unknown."""
    from replay.provenance.differences import _dict_differences
    from replay.replayer.suspects import sampler_suspect

    on = {"tensor_parallel_size": "1", "use_fp64_gumbel": "True", "enable_return_routed_experts": "True"}
    off = {"tensor_parallel_size": "1"}  # the builtin engine's layout has this much too
    (fp64, routing) = sorted(_dict_differences("engine_config", "layout", on, off, both_vllm=True),
                             key=lambda d: d.label, reverse=True)
    assert (fp64.label, fp64.a, fp64.b, fp64.affects) == ("use_fp64_gumbel", "True", "False", "layout")
    assert (routing.label, routing.affects) == ("enable_return_routed_experts", "host")
    assert _dict_differences("engine_config", "layout", on, off) == []  # against the builtin engine: unknown
    vllm, builtin = (msgspec.structs.replace(_header(**{"engine_config.layout": layout}), engine=engine)
                     for engine, layout in (("vllm", on), ("builtin", off)))
    assert not [d for d in header_differences(vllm, builtin) if d.label == "use_fp64_gumbel"]
    assert sampler_suspect([f"{fp64.label}: recorded True, replay False", "model: a vs b"]) == \
        "the sampler: same distribution, another draw (use_fp64_gumbel: recorded True, replay False)"


def test_an_openblas_variable_is_a_suspect_only_where_torch_may_read_it():
    """x86 torch runs its BLAS on MKL: OPENBLAS_* (some hosts set them for every process) is then numpy's alone, a
    host difference; where a side that sets it runs torch without MKL (aarch64's OpenBLAS), or its libraries are
    unknown (an older capture), it may change the numbers."""
    mkl = {"mkl": "2024.2", "cpu_capability": "AVX512"}
    cases = [({}, mkl, "host"), (mkl, mkl, "host"), ({}, {"cpu_capability": "DEFAULT"}, "numerics")]
    for recorded, replayed, affects in cases:
        a = _header(**{"environment.libraries": recorded})
        b = _header(**{"environment.libraries": replayed, "environment.env": {"OPENBLAS_CORETYPE": "Haswell"}})
        [d] = [d for d in header_differences(a, b) if d.label == "OPENBLAS_CORETYPE"]
        assert d.affects == affects, (recorded, replayed)
    a = _header(**{"environment.env": {"OPENBLAS_CORETYPE": "Zen"}})  # set where the libraries are unknown
    b = _header(**{"environment.libraries": mkl})
    [d] = [d for d in header_differences(a, b) if d.label == "OPENBLAS_CORETYPE"]
    assert d.affects == "numerics"
