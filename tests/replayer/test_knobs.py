"""`--set` knobs: ours, `vllm.ARG` (any vLLM engine argument) and `env.NAME` (an environment variable), each checked
in one place and refused, in one line that names it, where the chosen runner cannot apply it."""

from __future__ import annotations

import pytest

from replay.errors import UsageError
from replay.replayer import parse_overrides
from replay.replayer.knobs import check_overrides, env_knobs, split_knobs


def test_engine_arguments_and_environment_variables_parse_by_their_own_names():
    got = parse_overrides(["runner=vllm", "vllm.kv_cache_dtype=fp8", "vllm.max-num-batched-tokens=256",
                           "env.MKL_CBWR=COMPATIBLE", "env.OMP_WAIT_POLICY=", "env.X=a=b"])
    assert got == {"runner": "vllm", "vllm.kv_cache_dtype": "fp8", "vllm.max_num_batched_tokens": "256",
                   "env.MKL_CBWR": "COMPATIBLE", "env.OMP_WAIT_POLICY": "", "env.X": "a=b"}
    assert env_knobs(got) == {"MKL_CBWR": "COMPATIBLE", "OMP_WAIT_POLICY": None, "X": "a=b"}  # empty: unset


def test_an_engine_argument_we_also_name_is_our_knob():
    assert parse_overrides(["runner=vllm", "vllm.tensor_parallel_size=01", "vllm.dtype=bfloat16"]) == {
        "runner": "vllm", "tensor_parallel_size": "1", "dtype": "bfloat16"}


def test_environment_knobs_apply_to_both_runners():
    assert parse_overrides(["env.ATEN_CPU_CAPABILITY=avx2", "dtype=float64"]) == {
        "env.ATEN_CPU_CAPABILITY": "avx2", "dtype": "float64"}


@pytest.mark.parametrize("items,message", [
    (["vllm.kv_cache_dtype=fp8"], "vllm.kv_cache_dtype: a vLLM engine argument; the builtin runner cannot apply it"),
    (["runner=vllm", "vllm.=1"], "expected vllm.ARG=VALUE"),
    (["runner=vllm", "vllm.Bad-Name!=1"], "expected vllm.ARG=VALUE"),
    (["env.1BAD=x"], "expected env.NAME=VALUE"),
    (["env.NAME"], "expected env.NAME=VALUE"),
    (["runner=vllm", "threads=2"], "threads: builtin runner only"),
    (["nonsense=1"], "unknown knob 'nonsense'; knobs are .* vllm.ARG .* env.NAME"),
    (["dtype=float99"], "dtype=float99: expected one of float32, bfloat16, float16, float64 on the builtin runner"),
    (["dtype=half"], "dtype=half: expected one of float32, bfloat16, float16, float64 on the builtin runner"),
    (["runner=vllm", "dtype=float64"], "dtype=float64: expected one of float32, .*, auto on the vllm runner"),
])
def test_what_a_runner_cannot_apply_is_refused_in_one_line(items, message):
    with pytest.raises(UsageError, match=message):
        parse_overrides(items)


def test_knob_lists_split_only_where_another_knob_starts():
    assert split_knobs('runner=vllm,vllm.speculative_config={"method": "ngram", "k": 3},env.X=a,b') == [
        "runner=vllm", 'vllm.speculative_config={"method": "ngram", "k": 3}', "env.X=a,b"]
    assert split_knobs("") == []


def test_a_refusal_names_the_flag_the_knobs_came_with():
    with pytest.raises(UsageError, match=r"^--against 'garbage': expected KNOB=VALUE"):
        parse_overrides(["garbage"], "--against")
    with pytest.raises(UsageError, match=r"^--set 'garbage': expected KNOB=VALUE"):
        parse_overrides(["garbage"])


def test_python_callers_give_knobs_as_a_dict_a_string_or_a_list_and_the_runner_by_keyword():
    want = {"dtype": "bfloat16", "threads": "2"}
    assert check_overrides({"dtype": "bfloat16", "threads": 2}) == want
    assert check_overrides("dtype=bfloat16,threads=2") == want
    assert check_overrides(["dtype=bfloat16", "threads=2"]) == want
    assert check_overrides(None) == {} and check_overrides("", runner="builtin") == {}
    assert check_overrides("tensor_parallel_size=2", runner="vllm") == {"tensor_parallel_size": "2", "runner": "vllm"}
    assert check_overrides({"runner": "vllm"}, runner="vllm") == {"runner": "vllm"}
    with pytest.raises(UsageError, match="runner='builtin' and the knob runner=vllm say two things"):
        check_overrides({"runner": "vllm"}, runner="builtin")
    with pytest.raises(UsageError, match="a vLLM layout knob; it needs vLLM's runner"):
        check_overrides("tensor_parallel_size=2", runner="builtin")
    with pytest.raises(UsageError, match="runner 'vLLM': expected builtin or vllm"):
        check_overrides(None, runner="vLLM")
