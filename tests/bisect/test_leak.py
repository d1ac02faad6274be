"""`bisect leak` on the builtin runner: a planted leak (R's rows take a multiple of a neighbour's) is named with its
neighbour and module, exit 1; without it nothing moves although every swapped neighbour samples otherwise, exit 0;
a fault of the batch's size alone is not called contamination; from a keyframe, requests live there are kept and
a neighbour that arrived after it is found as from step 0.

`keyed_capture` (tests/conftest.py): a keyframe every 4 steps; r6 decodes beside r7 in steps 21-34, and r7 is
preempted at step 26 and resumed (recomputed) at 27, so a swap carries it through a resume.
"""

from __future__ import annotations

import json

import pytest

from replay.bisect.leak import CONTAMINATION, NO_LEAK, bisect_leak
from replay.cli import main
from replay.errors import CannotTestError
from replay.replayer import Plant


def test_a_planted_leak_is_named_with_its_neighbour_and_module_and_exits_1(keyed_capture, capsys):
    plant = "29:r6:layers.1.self_attn.o_proj:0.02*r7"
    code = main(["bisect", "leak", str(keyed_capture), "--step", "29", "--request", "r6", "--from-start",
                 "--plant", plant, "--json", "-q"])
    res = json.loads(capsys.readouterr().out)
    assert code == 1 and res["found"] == CONTAMINATION
    assert res["minimal_set"] == ["r7"] and res["first_module"] == "layers.1.self_attn.o_proj", res["verdict"]
    assert res["tests"][0]["moved"] and res["tests"][0]["neighbours_changed"] >= 1
    earlier = [m for m in res["modules"] if m["module"] != "layers.1.self_attn.o_proj"][:5]
    assert all(m["equal"] for m in earlier)  # the modules before it ran on R's rows alone


def test_without_a_fault_nothing_moves_though_every_swap_took_effect(keyed_capture, capsys):
    code = main(["bisect", "leak", str(keyed_capture), "--step", "29", "--request", "r6", "--from-start", "-q"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(NO_LEAK), out
    res = bisect_leak(keyed_capture, 29, "r6", from_start=True)
    assert [t.content for t in res.tests] == ["random", "shuffled", "repeated"]
    assert all(not t.moved and t.neighbours_changed == t.neighbours_sampling > 0 for t in res.tests), res.tests
    assert sorted(res.neighbours) == ["r3", "r4", "r5", "r7"] and res.re_executions == 4


def test_a_fault_of_the_batchs_size_alone_is_not_contamination(keyed_capture):
    plant = Plant(29, "r6", "layers.0.mlp", 1e-3, "#batch")
    res = bisect_leak(keyed_capture, 29, "r6", plant=plant, from_start=True)
    assert res.found == NO_LEAK, res.verdict


def test_from_a_keyframe_live_requests_are_kept_and_a_later_neighbour_is_found_as_from_step_0(keyed_capture):
    """r6's neighbours at step 23 (r4, r5, r7): r4 and r5 are live at the keyframe of step 20 and stay as recorded;
    r7, which arrived after it, is swapped and found, as from step 0. (Where every neighbour is live at the nearest
    keyframe, the replay starts earlier: tests/bisect/test_from_keyframe.py.)"""
    plant = Plant(23, "r6", "layers.0.self_attn", 0.05, "r7")
    near = bisect_leak(keyed_capture, 23, "r6", plant=plant)
    far = bisect_leak(keyed_capture, 23, "r6", plant=plant, from_start=True)
    assert near.minimal_set == far.minimal_set == ["r7"] and near.first_module == far.first_module
    assert near.neighbours == ["r7"] and {"r4", "r5"} <= set(near.kept)
    assert any("keyframe at step 20" in n for n in near.notes), near.notes


def test_a_mixture_of_experts_is_refused_by_name(keyed_capture, tmp_path):
    """A token's experts follow its content: other content regroups the experts' GEMMs, a shape the swap cannot
    keep. The same capture, its header saying the model routes over 8 experts, cannot be tested (exit 125)."""
    import msgspec

    from replay.capture import CaptureReader, CaptureWriter

    with CaptureReader(keyed_capture) as r:
        header, records = r.header, list(r.records())
    model = msgspec.structs.replace(header.model, config={**header.model.config, "num_local_experts": 8})
    moe = tmp_path / "moe.capture"
    with CaptureWriter(moe, msgspec.structs.replace(header, model=model), keyframes=0) as w:
        for rec in records:
            w.write_record(rec)
    with pytest.raises(CannotTestError, match="is a mixture of experts .num_local_experts=8."):
        bisect_leak(moe, 29, "r6", from_start=True)


def test_a_twin_whose_kv_the_request_reads_is_swapped_after_it_and_its_leak_found(tmp_path):
    """b finds 16 of its tokens in a's KV blocks (prefix caching), beside a: a cannot be left out or swapped whole,
    since b reads what a wrote, but its tokens after those can carry other content; a leak from a is found."""
    from testbed.twins import record_twins

    capture = record_twins(tmp_path / "partner.capture", prefix_caching=True, b_at=3)
    step = 4  # (b's first decode, beside a)
    clean = bisect_leak(capture, step, "b")
    assert clean.found == NO_LEAK and "a" in clean.neighbours and "a" not in clean.kept, clean.verdict
    assert "a after its first 16 tokens" in clean.verdict
    leaky = bisect_leak(capture, step, "b", plant=Plant.parse(f"{step}:b:layers.0.mlp:0.05*a"))
    assert leaky.found == CONTAMINATION and leaky.minimal_set == ["a"], leaky.verdict
