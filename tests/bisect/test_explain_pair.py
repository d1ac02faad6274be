"""`explain --pair` and `--pairs` on the builtin runner. Twin greedy requests (one prompt, one sampling,
`testbed.twins`): `a` in a batch of six at step 0, `b` later beside `c`. Without prefix caching their own schedules
match: alone they are bitwise equal, the swap moves nobody, so the batch's shape parted them (BATCH VARIANCE, exit
0); with a leak planted, the swap names the neighbour and the module (CONTAMINATION, exit 1). With prefix caching
`b` prefills 4 tokens after a hit of 16: alone they part, each repeating itself, and the verdict names the two
schedules. A leak in the engine that recorded them is contamination whatever the schedules do alone."""

from __future__ import annotations

import json

import pytest

from replay.bisect.explain_pair import BATCH_VARIANCE, NOT_REPEATABLE, NOTHING, explain_pair
from replay.bisect.leak import CONTAMINATION
from replay.capture import CaptureReader, RequestAdded
from replay.cli import main
from replay.diff.twins import twin_groups
from replay.errors import UsageError
from testbed.twins import record_twins


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    d = tmp_path_factory.mktemp("twins")
    return record_twins(d / "twins.capture"), record_twins(d / "cached.capture", prefix_caching=True)


def test_pairs_lists_the_twins_that_answered_differently_and_explains_batch_variance(twins, capsys):
    plain, _ = twins
    [group] = twin_groups(plain)
    assert group.requests == ["a", "b"] and group.kind == "logprobs"  # c samples: not a twin of theirs
    code = main(["explain", str(plain), "--pairs", "-q"])
    out = capsys.readouterr().out
    assert code == 0 and "answered differently (of 1 compared):\n  a, b: part at output position" in out, out
    assert f"\n{BATCH_VARIANCE}: requests a and b are bitwise equal alone" in out, out
    assert "batches: 6 requests, 80 tokens (6 prefill) at step 0, 2 requests, 40 tokens (2 prefill) at step" in out


def test_pairs_explains_the_two_that_part_first_not_the_first_two(tmp_path, capsys):
    """Three twins, `a` and `d` in one batch (the same answer), `b` later: the first two listed agree, so `--pairs`
    explains `a` and `b`, the first pair that parts where the group does."""
    path = record_twins(tmp_path / "three.capture", d_beside_a=True)
    if explain_pair(path, "a", "d").found != NOTHING:
        pytest.skip("this processor's kernels gave two rows of one batch other bits: no agreeing first two")
    [group] = twin_groups(path)
    assert group.requests == ["a", "d", "b"] and group.pair == ["a", "b"], group
    assert main(["explain", str(path), "--pairs", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"a, d, b: a and b part at output position {group.position}" in out, out
    assert "requests a and b" in out.splitlines()[2], out


def test_pairs_json_has_one_shape_with_twins_or_without(twins, tmp_path, capsys):
    """Every group and the first one's explanation, or no group and no explanation: a script reads one shape."""
    plain, _ = twins
    main(["explain", str(plain), "--pairs", "--json", "-q"])
    out = json.loads(capsys.readouterr().out)
    assert [g["requests"] for g in out["groups"]] == [["a", "b"]] and out["explanation"]["found"] == BATCH_VARIANCE
    assert out["compared"] == 1
    (tmp_path / "pairs.json").write_text(json.dumps(out))  # what the report takes: the first group's explanation
    assert main(["report", str(plain), "--explain", str(tmp_path / "pairs.json"), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert f'data-found="{BATCH_VARIANCE}"' in page and "a, b: part at output position" in page  # and every group
    capsys.readouterr()
    none = record_twins(tmp_path / "invariant.capture", batch_invariant=True)  # twins that agree: no group
    assert main(["explain", str(none), "--pairs", "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out) == {"groups": [], "compared": 1, "explanation": None}


def test_pairs_says_how_many_groups_it_compared_or_that_there_were_none(twins, small_capture, tmp_path, capsys):
    """Twins that agree and a capture with no twins at all are two answers: neither hides behind the other."""
    none = record_twins(tmp_path / "invariant.capture", batch_invariant=True)
    assert main(["explain", str(none), "--pairs", "-q"]) == 0
    assert capsys.readouterr().out == ("no two requests with the same prompt and sampling answered differently "
                                       "(1 group(s) of twins compared)\n")
    assert main(["explain", str(small_capture), "--pairs", "-q"]) == 0
    assert capsys.readouterr().out == ("no two requests share a prompt and sampling (greedy, or one seed): no twins "
                                       "to compare\n")


def test_a_planted_leak_makes_the_pair_contamination_with_the_neighbour_and_module(twins, capsys):
    plain, _ = twins
    code = main(["explain", str(plain), "--pair", "a", "b", "--plant", "0:a:layers.0.mlp:0.05*n2", "--json", "-q"])
    res = json.loads(capsys.readouterr().out)
    assert code == 1 and res["found"] == CONTAMINATION and res["bug"]
    assert res["alone_equal"] and res["leak"]["minimal_set"] == ["n2"]
    assert res["leak"]["first_module"] == "layers.0.mlp", res["verdict"]


def test_twins_on_schedules_of_their_own_part_alone_and_the_verdict_names_both(twins):
    """Whether the two schedules give other numbers is the processor's kernels' to say: on the Intel Xeons with AMX
    of earlier runs a 20-token prefill and a 4-token one after a hit part (the verdict then names both schedules);
    on an AMD EPYC with AVX512 they came out bitwise equal alone, and the batch's shape is what parted the twins."""
    _, cached = twins
    res = explain_pair(cached, "a", "b")
    assert res.found == BATCH_VARIANCE and not res.bug, res.verdict
    if res.alone_equal:
        assert f"{BATCH_VARIANCE}: requests a and b are bitwise equal alone" in res.verdict
        assert "2 requests, 8 tokens (2 prefill) at step" in res.verdict  # (b's 4 after its hit, beside c's)
    else:
        assert "prefill chunks [20] against prefill chunks [4] after a prefix-cache hit of 16 tokens" in res.verdict


def test_a_fault_of_shape_parts_the_cached_twins_alone_and_the_verdict_names_both_schedules(tmp_path, monkeypatch):
    """The branch above that depends on the processor, on any processor: a fault that adds to each row a multiple
    of its step's token count (`replay.faults`), in the recording's engine and the replay's as a kernel's would be,
    parts a 20-token prefill from a 4-token one."""
    monkeypatch.setenv("REPLAY_TEST_FAULT", "shape:layers.0.mlp:0.001")
    cached = record_twins(tmp_path / "cached.capture", prefix_caching=True)
    res = explain_pair(cached, "a", "b")
    assert res.found == BATCH_VARIANCE and not res.bug and not res.alone_equal, res.verdict
    assert "prefill chunks [20] against prefill chunks [4] after a prefix-cache hit of 16 tokens" in res.verdict


def test_a_pair_that_agrees_or_is_not_a_pair_is_said_so(twins, tmp_path, capsys):
    plain, _ = twins
    agree = record_twins(tmp_path / "invariant.capture", batch_invariant=True)
    assert explain_pair(agree, "a", "b").found == NOTHING
    assert main(["explain", str(agree), "--pair", "a", "b", "-q"]) == 0
    assert capsys.readouterr().out == f"{NOTHING}: requests a and b gave the same 10 tokens and logprobs\n"  # no replay
    with pytest.raises(UsageError, match="do not share their prompt and sampling"):
        explain_pair(plain, "a", "c")
    with pytest.raises(UsageError, match="name two different requests"):  # a request is not its own twin
        explain_pair(plain, "n0", "n0")
    with CaptureReader(agree) as r:  # an internal id, as divergences and bisects print it, names its request too
        internal = next(rec.request.request_id for rec in r.records()
                        if isinstance(rec, RequestAdded) and rec.request.name == "a")
    assert internal != "a" and explain_pair(agree, internal, "b").found == NOTHING
    with pytest.raises(UsageError, match="name two different requests"):
        explain_pair(agree, internal, "a")


def test_a_leak_is_contamination_though_the_twins_schedules_part_them_a_little_alone(tmp_path, monkeypatch, capsys):
    """A recording made with a leak in the engine (`replay.faults`): `a` first in its batch (the row the leak
    reads, never one it writes into), `b` beside the neighbours, prefilling 1 token after a prefix-cache hit of 20.
    The twins' recorded rows part by ~0.03; alone a 21-token prefill and a 1-token one part by a few ULPs (~5e-6 on
    the processors seen so far), at most twice that in a logprob: far too little, so the swap runs and finds `a`'s
    content in `b` (`b` reads its batch's first row). Not BATCH VARIANCE, which the schedules alone once concluded."""
    monkeypatch.setenv("REPLAY_TEST_FAULT", "leak:layers.0.mlp:0.01")
    path = record_twins(tmp_path / "leaky.capture", prefix_caching=True, a_first=True, twin_len=21, b_at=2)
    code = main(["explain", str(path), "--pairs", "--json", "-q"])
    out = json.loads(capsys.readouterr().out)
    res = out["explanation"]  # (beside every group of twins found: here the one)
    assert [g["requests"] for g in out["groups"]] == [["a", "b"]], out["groups"]
    assert code == 1 and res["found"] == CONTAMINATION and res["bug"], res["verdict"]
    assert res["leak"]["request"] == "b" and res["leak"]["minimal_set"] == ["a"], res["verdict"]
    assert res["recorded_max_abs_logprob_diff"] > 0.01
    if not res["alone_equal"]:  # (what the processor's kernels make of the two schedules: see the test above)
        assert "too little for the recorded max |Δlogprob|" in res["verdict"], res["verdict"]
    step = res["leak"]["step"]
    assert res["command"] == f"replay bisect leak {path} --step {step} --request b"
    assert main(res["command"].split()[1:] + ["-q"]) == 1  # it reproduces: the leak, named
    assert "CONTAMINATION" in capsys.readouterr().out


def test_a_leak_into_the_twin_whose_blocks_the_other_hits_is_contamination_not_their_schedules(tmp_path, monkeypatch):
    """`a`, sixth in its batch, takes n0's rows; `b` later reads `a`'s K/V through the prefix cache, so alone (`a`
    kept, as recorded) it carries the leak and `a` alone does not: they part alone by more than the recording shows.
    Their schedules differ too, which rules no leak out: the swap on `a`'s neighbours names n0."""
    monkeypatch.setenv("REPLAY_TEST_FAULT", "leak:layers.0.mlp:0.01")
    res = explain_pair(record_twins(tmp_path / "donor.capture", prefix_caching=True), "a", "b")
    assert res.found == CONTAMINATION and res.bug and not res.alone_equal, res.verdict
    assert res.leak.request == "a" and res.leak.minimal_set == ["n0"], res.verdict


def test_twins_the_replay_of_their_own_batches_does_not_part_are_no_batch_variance(tmp_path, monkeypatch):
    """Recorded with a leak the replay lacks (a kernel bug of the recording's engine, fixed since, or one the replay
    is not given): alone equal, no neighbour's content moves them, and yet their batches as recorded, replayed, do
    not part them as recorded. Not BATCH VARIANCE (exit 0), which nothing here reproduced: the recording is not
    repeatable (exit 1)."""
    monkeypatch.setenv("REPLAY_TEST_FAULT", "leak:layers.0.mlp:0.01")  # `a`, sixth in its batch, takes n0's rows
    path = record_twins(tmp_path / "leaky.capture")
    monkeypatch.delenv("REPLAY_TEST_FAULT")
    res = explain_pair(path, "a", "b")
    assert res.found == NOT_REPEATABLE and res.bug and res.alone_equal, res.verdict
    assert "replayed in their recorded batches" in res.verdict and "from its recorded one" in res.verdict, res.verdict
    assert res.command == f"replay run {path} --diff --steps {res.step_a}-{res.step_b}"
    assert main(["explain", str(path), "--pair", "a", "b", "-q"]) == 1


def test_the_bound_on_what_the_schedules_move_follows_the_recorded_quantity():
    """A logit moved by d moves a logprob by at most 2d and a logit by d; vLLM's processed values are of logits over
    the temperature, so a seeded twin at temperature 0.5 may part by 4d in processed logprobs."""
    from replay.bisect.explain_pair import _reach

    assert _reach("raw_logprobs", 0.5) == 2.0 and _reach("raw_logits", 0.5) == 1.0
    assert _reach("processed_logprobs", 0.5) == 4.0 and _reach("processed_logits", 0.25) == 4.0
    assert _reach("processed_logprobs", 0.0) == 2.0  # greedy: no temperature applied


def test_twins_asked_to_stop_apart_or_for_other_logprobs_are_compared_over_their_common_tokens(tmp_path, capsys):
    """The same prompt, greedy, but `b` asks for 6 tokens and 5 logprobs where `a` asks for 10 and 3, and carries a
    seed and a temperature below vLLM's greedy threshold (greedy either way: nothing is drawn): still twins, compared
    over their common 6 tokens and 3 logprobs; stopping 4 tokens sooner is no parting."""
    b = {"max_tokens": 6, "logprobs": 5, "seed": 7, "temperature": 1e-6}
    same = record_twins(tmp_path / "invariant.capture", batch_invariant=True, b_params=b)
    assert main(["explain", str(same), "--pairs", "-q"]) == 0
    assert "(1 group(s) of twins compared)" in capsys.readouterr().out
    res = explain_pair(same, "a", "b")
    assert res.found == NOTHING and res.verdict == (f"{NOTHING}: requests a and b gave the same 6 tokens and logprobs "
                                                    "(of 10 and 6: they were asked to stop apart)"), res.verdict
    plain = record_twins(tmp_path / "plain.capture", b_params=b)
    [group] = twin_groups(plain)
    assert group.requests == ["a", "b"] and group.kind == "logprobs" and group.position < 6, group
    stopped = {"max_tokens": 6, "ignore_eos": True, "stop_token_ids": [3]}
    stops = record_twins(tmp_path / "stops.capture", batch_invariant=True, b_params=stopped)
    assert twin_groups(stops) == []  # its stop tokens differ too: still no parting
    sampled = record_twins(tmp_path / "sampled.capture", batch_invariant=True, b_params={"repetition_penalty": 1.5})
    with pytest.raises(UsageError, match="do not share their prompt and sampling"):
        explain_pair(sampled, "a", "b")  # a penalty changes what it samples: no twin
