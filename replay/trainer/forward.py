"""The trainer's forward: one teacher-forced pass of prompt + generated tokens through `transformers`, in the
trainer's dtype and attention, micro-batched as a trainer batches (right padding, an attention mask)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from replay.errors import CannotTestError, UsageError
from replay.trainer.rollouts import Rollout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = ("sdpa", "eager")


def load_model(path: str, dtype: str, attention: str) -> Any:
    """The checkpoint at `path` as a `transformers` causal LM, in eval mode on CPU."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if attention not in ATTENTION:
        raise UsageError(f"--attn {attention}: expected one of {', '.join(ATTENTION)}")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise CannotTestError("replay trainer scores with transformers, which is not installed: "
                              "pip install 'replay[trainer]'") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attention)
    except OSError as e:
        raise UsageError(f"--model {path}: not a checkpoint transformers can load ({str(e).splitlines()[0]})") from None
    return model.eval()


def teacher_forced(model: Any, rollouts: list[Rollout], micro_batch: int) -> Iterator[tuple[Rollout, torch.Tensor]]:
    """Each rollout with its logits at the positions that predicted its generated tokens: [G, V] float32 (the
    trainer casts before its log_softmax). Rollouts go `micro_batch` at a time, right-padded."""
    for first in range(0, len(rollouts), micro_batch):
        batch = rollouts[first:first + micro_batch]
        seqs = [r.prompt + r.tokens for r in batch]
        width = max(map(len, seqs))
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits  # [B, width, V]
        for i, r in enumerate(batch):
            p = len(r.prompt)
            yield r, logits[i, p - 1:p - 1 + len(r.tokens)].float()
