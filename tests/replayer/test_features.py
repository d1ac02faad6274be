"""Recorded features a runner cannot honour are refused by name before the first step; `--force` replays anyway
and lists them as ignored. The builtin engine cannot record these features, so this test writes them into a copy
of a real builtin capture (the LoRA request as vLLM's LoRARequest image leaves it: name, id, path); the same
replay of a real vLLM speculative-decoding capture, and a real refusal, are in tests/integrations/vllm/."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from replay.capture import CaptureReader, CaptureWriter, Step
from replay.cli import main
from replay.contracts import Opaque
from replay.errors import UsageError
from replay.record import EngineOptions, SyntheticWorkload, record, synthetic
from replay.replayer import ReplayOptions, check_capture, replay_capture
from replay.report import write_report


@pytest.fixture(scope="module")
def tiny_capture(tmp_path_factory):
    path = tmp_path_factory.mktemp("features") / "tiny.capture"
    wl = SyntheticWorkload(num_requests=4, output_len=(3, 6), sampling="greedy")
    record(EngineOptions(model="tiny", threads=1), synthetic(wl, 512), path)
    return path


def _with(src, dst, *, lora_on: int | None = None, encoder_at: int | None = None):
    """A copy of `src` where the `lora_on`-th new request carries a LoRA adapter, and step `encoder_at` schedules
    encoder inputs (a multimodal item) for its first request."""
    seen = 0
    with CaptureReader(src) as r, CaptureWriter(dst, r.header) as w:
        for rec in r.records():
            if isinstance(rec, Step):
                so = rec.scheduler_output
                new = []
                for n in so.scheduled_new_reqs:
                    if seen == lora_on:
                        n = msgspec.structs.replace(n, lora_request=Opaque("sql-lora", 1, "/adapters/sql-lora"))
                    seen += 1
                    new.append(n)
                enc = dict(so.scheduled_encoder_inputs)
                if rec.index == encoder_at:
                    enc[next(iter(so.num_scheduled_tokens))] = [0]
                so = msgspec.structs.replace(so, scheduled_new_reqs=new, scheduled_encoder_inputs=enc)
                rec = msgspec.structs.replace(rec, scheduler_output=so)
            w.write_record(rec)
    return dst


def test_a_lora_adapter_that_is_not_there_is_refused_by_name_before_the_first_step(tiny_capture, tmp_path):
    cap = _with(tiny_capture, tmp_path / "lora.capture", lora_on=1)
    with pytest.raises(UsageError, match=r"LoRA adapter 'sql-lora': /adapters/sql-lora is not there; --force"):
        replay_capture(cap)
    res = check_capture(cap)
    assert res.verdict == "cannot test" and "LoRA adapter 'sql-lora'" in res.reason


def test_force_replays_and_lists_what_it_ignored(tiny_capture, tmp_path, capsys):
    cap = _with(tiny_capture, tmp_path / "both.capture", lora_on=0, encoder_at=2)
    rep = replay_capture(cap, ReplayOptions(force=True))
    assert [f.split(":")[0] for f in rep.ignored] == ["multimodal inputs", "LoRA adapter 'sql-lora'"]
    assert "encoder inputs scheduled" in rep.ignored[0] and "its requests replay without it" in rep.ignored[1]
    assert main(["run", str(cap), "--diff"]) == 2
    assert "cannot replay what this capture records: multimodal inputs: step 2" in capsys.readouterr().err
    main(["run", str(cap), "--diff", "--force"])
    assert "ignored (--force): multimodal inputs: step 2" in capsys.readouterr().out
    page = Path(write_report(cap, tmp_path / "report.html", replay=ReplayOptions(force=True)).path).read_text()
    assert "ignored (--force): multimodal inputs: step 2" in page  # the HTML report lists it too


def test_a_plain_capture_has_nothing_to_refuse(tiny_capture):
    assert replay_capture(tiny_capture).ignored == []
