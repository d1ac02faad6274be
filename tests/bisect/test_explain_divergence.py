"""`explain CAPTURE` on a replay divergence, builtin runner: each class it can reach here, with its exit code.

- CONFIG (hardware unknown): `captures/format-1.0-loaded.capture`, written by the first release (format 1.0, no
  processor or library settings in its header) on a loaded machine, diverges on any quiet replay; the replay's
  verdict says the recording's hardware is unknown, and `explain` classes it CONFIG, never a bug;
- CONFIG (a knob): `--set dtype=bfloat16` (the README demo's divergence) and `--set env.MKL_CBWR=COMPATIBLE` (an
  environment variable, replayed in a fresh process), found by `bisect config`;
- CONTAMINATION: a leak planted in the replay only, exit 1 with the `bisect leak` command that shows it;
- NOTHING TO EXPLAIN: a replay that matches.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from replay.bisect.explain_divergence import CONFIG, NOTHING, explain_divergence
from replay.bisect.leak import CONTAMINATION
from replay.capture import StepRange
from replay.cli import main
from replay.replayer import ReplayOptions, replay_capture

OLD = Path(__file__).resolve().parents[2] / "captures" / "format-1.0-loaded.capture"


@pytest.fixture
def old(tmp_path):
    return shutil.copy(OLD, tmp_path / OLD.name)


def test_a_first_release_capture_names_its_unknown_hardware_and_is_config_not_a_bug(old, capsys):
    rep = replay_capture(old, ReplayOptions())
    assert rep.diverged and rep.unknown.startswith("the recording's header does not name its processor")
    assert any("does not name its processor" in n for n in rep.environment_differences)
    code = main(["explain", str(old), "--json", "-q"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["found"] == CONFIG and not res["bug"], res["verdict"]
    assert res["verdict"].startswith("CONFIG (hardware unknown)") and "--tolerance auto" in res["command"]
    # the size it names beyond the cross-hardware tolerance is that replay's, under the name of its own request
    d = rep.first_divergence
    a = replay_capture(old, ReplayOptions(auto_tolerance=True, steps=StepRange(0, d.step))).first_divergence
    if a is None:  # (this processor computes the recording's numbers within it)
        assert "within the cross-hardware tolerance (atol" in res["verdict"], res["verdict"]
    else:
        assert f"max |Δlogprob| {a.max_abs_logprob_diff:.3g})" in res["verdict"], res["verdict"]
        assert (a.request_id, a.step) == (d.request_id, d.step) or \
            f"request {a.request_id} at step {a.step}, " in res["verdict"], res["verdict"]
        assert a.kind != "token" or f"token {a.expected_token} became {a.actual_token}" in res["verdict"]


def test_a_flip_beyond_a_tolerance_is_said_as_a_flip_not_as_a_size_within_it():
    """A token flip parts by no logprob at all where the tokens' rows are not held: "beyond atol 1e-4, max
    |Δlogprob| 0" would contradict itself."""
    from replay.bisect.explain_divergence import _how
    from replay.diff import Divergence

    flip = Divergence(3, "r", 0, "token", expected_token=5, actual_token=9, max_abs_logprob_diff=0.0)
    assert _how(flip) == "token 5 became 9, max |Δlogprob| 0"
    assert _how(Divergence(3, "r", 0, "routed_experts")) == "a routed experts divergence"


def _reproduce(out: str) -> list[str]:
    """The arguments of the command an explanation printed."""
    [line] = [x for x in out.splitlines() if x.strip().startswith("reproduce: ")]
    args = shlex.split(line.split("reproduce: ", 1)[1])
    assert args[0] == "replay", line
    return args[1:]


def test_a_knob_is_found_as_the_config_that_parts_the_replay(keyed_capture, capsys):
    code = main(["explain", str(keyed_capture), "--set", "dtype=bfloat16", "--atol", "1e-6", "-q"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(f"{CONFIG}: ") and "changing dtype=bfloat16 alone" in out, out
    # the command it prints finds the same, under the tolerance it was given
    args = _reproduce(out)
    assert args[:2] == ["bisect", "config"] and "--atol" in args, args
    code = main([*args, "-q"])
    assert code == 0 and "changing dtype=bfloat16 alone" in capsys.readouterr().out
    res = explain_divergence(keyed_capture, ReplayOptions(overrides={"env.MKL_CBWR": "COMPATIBLE"}))
    assert res.found == CONFIG and res.config.minimal_change == {"env.MKL_CBWR": "COMPATIBLE"}, res.verdict


def test_a_leak_planted_in_the_replay_is_contamination_with_its_command(keyed_capture, capsys):
    plant = "29:r6:layers.1.self_attn.o_proj:0.02*r7"
    code = main(["explain", str(keyed_capture), "--plant", plant, "--from-start", "-q"])
    out = capsys.readouterr().out
    assert code == 1 and out.startswith(f"{CONTAMINATION}: request r6 at step 29"), out
    assert f"reproduce: replay bisect leak {keyed_capture} --step 29 --request r6 --plant '{plant}' --from-start" in out
    assert "first module whose output for it moves is layers.1.self_attn.o_proj" in out
    code = main([*_reproduce(out), "-q"])
    assert code == 1 and "layers.1.self_attn.o_proj" in capsys.readouterr().out


def test_a_replay_that_matches_has_nothing_to_explain(keyed_capture):
    res = explain_divergence(keyed_capture)
    assert res.found == NOTHING and not res.bug and res.re_executions == 2


def test_a_request_no_step_schedules_is_a_mistake_not_a_match(keyed_capture, capsys):
    code = main(["explain", str(keyed_capture), "--step", "5", "--request", "nope"])
    assert code == 2 and "no step 5 scheduling request 'nope'" in capsys.readouterr().err


def test_the_config_command_keeps_the_runner_on_the_good_side_and_the_tolerance():
    """On vLLM's runner the good side is vLLM's runner as recorded: without it the good side replays on ours and
    already diverges, and the bisect refuses."""
    from replay.bisect.explain_divergence import _config_command
    from replay.diff import Tolerance

    opts = ReplayOptions(overrides={"runner": "vllm", "tensor_parallel_size": "1"})
    cmd = _config_command("a b.capture", {"runner": "vllm"}, opts, 7, Tolerance(atol=1e-4))
    assert cmd == ("replay bisect config 'a b.capture' --good runner=vllm --bad runner=vllm,tensor_parallel_size=1 "
                   "--steps 0-7 --atol 0.0001 --rtol 0"), cmd


def test_a_capture_cut_short_is_explained_on_its_readable_prefix_and_exits_3(keyed_capture, tmp_path, capsys):
    cut = tmp_path / "cut.capture"
    data = Path(keyed_capture).read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    code = main(["explain", str(cut), "-q"])
    out = capsys.readouterr().out
    assert code == 3 and out.startswith(f"{NOTHING}: ") and "only its readable prefix was replayed" in out, out


def test_vllm_cpus_lora_slots_are_a_setting_on_the_builtin_runner_only():
    """The builtin runner has no LoRA slots, so there the suspect is what it runs otherwise (CONFIG); on vLLM's runner
    the slots are the engine's own and the tests that follow class the divergence, the suspect kept as evidence."""
    from types import SimpleNamespace

    from replay.bisect.explain_divergence import _config
    from replay.replayer.suspects import LORA_SLOTS

    rep = SimpleNamespace(suspect=LORA_SLOTS + "...", unknown="", environment_differences=[])
    common = dict(runner="builtin", notes=[], data_lost=[])
    found = _config("x.capture", rep, ReplayOptions(), None, "at", "cmd", 2, common, print)
    assert found is not None and found.found == CONFIG and LORA_SLOTS in found.verdict
    on_vllm = ReplayOptions(overrides={"runner": "vllm"})
    assert _config("x.capture", rep, on_vllm, None, "at", "cmd", 2, dict(common, runner="vllm"), print) is None
