"""The trainer's packed forward: the two ways a packed row reaches transformers give the same bits."""

import pytest
import torch

pytest.importorskip("transformers")

from replay.trainer.forward import _packed, load_model  # noqa: E402
from testbed.checkpoints import tiny_llama  # noqa: E402


def test_a_row_packed_by_position_ids_alone_is_the_row_with_its_mask(tmp_path):
    """flash_attention_2 gets the packed row as padding-free trainers give it (position ids, no mask), which only a
    GPU runs; on sdpa, transformers reads the same sequences from those ids: what our block-diagonal mask gives, bit
    for bit, and each sequence's logits as it has them alone (within float32's rounding: other shapes)."""
    model = load_model(str(tiny_llama(tmp_path / "tiny-llama")), "float32", "sdpa")
    seqs = [[(7 * i + 3 * j) % 1000 + 3 for j in range(9 + 5 * i)] for i in range(4)]
    with torch.inference_mode():
        masked, ids_only = (model(**_packed(seqs, mask)[0], use_cache=False).logits for mask in (True, False))
        alone = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in seqs]
    assert torch.equal(masked, ids_only)
    assert torch.allclose(ids_only[0], torch.cat(alone), atol=1e-5, rtol=0)
