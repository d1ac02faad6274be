"""LoRA on the builtin model: a peft-format adapter applied by forward hooks equals the same model with the update
merged into its weights (W + alpha/r B A), for the tokens of the requests that use it, and leaves the other tokens'
bits alone."""

from __future__ import annotations

import copy

import pytest
import torch

from replay.engine.lora import LoRAHooks, load_adapter
from replay.engine.model import ContiguousAttention
from replay.engine.weights import load_checkpoint
from replay.errors import UsageError
from testbed.checkpoints import lora_adapter, tiny_llama

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    tiny_llama(d / "llama")
    lora_adapter(d / "llama", d / "adapter")
    model, _, _ = load_checkpoint(d / "llama", torch.float32, "cpu")
    return model, d / "adapter"


def _forward(model, seqs):
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([p for s in seqs for p in range(len(s))])
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos, ContiguousAttention([len(s) for s in seqs])))


def test_hooked_adapter_equals_merged_weights_on_its_rows_only(model_and_adapter):
    model, path = model_and_adapter
    seqs = [[5, 9, 200, 31, 7], [44, 45, 46]]
    base = _forward(model, seqs)
    merged = copy.deepcopy(model)
    adapter = load_adapter("sql", path, merged)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for name, (a, b) in adapter.weights.items():
            modules[name].weight += adapter.scale * (b @ a)
    expected = _forward(merged, seqs)
    hooks = LoRAHooks(model)
    hooks.add("sql", str(path))
    hooks.set_rows({"sql": [0, 1, 2, 3, 4]}, torch.device("cpu"))  # the first sequence only
    got = _forward(model, seqs)
    hooks.close()
    assert adapter.scale == 2.0 and len(adapter.weights) == 4  # alpha 16 / r 8, q and v of two layers
    assert torch.allclose(got[:5], expected[:5], atol=1e-5) and not torch.allclose(got[:5], base[:5], atol=1e-3)
    assert torch.equal(got[5:], base[5:])  # the other request's tokens: not touched, bit for bit
    assert torch.equal(_forward(model, seqs), base)  # hooks removed: the model is the base model again


def test_an_adapter_for_another_model_is_refused_by_name(model_and_adapter, tmp_path):
    model, path = model_and_adapter
    (tmp_path / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    with pytest.raises(UsageError, match="LoRA adapter 'other'.*cannot read it"):
        load_adapter("other", tmp_path, model)
