"""The trainer's forward: one teacher-forced pass of prompt + generated tokens through `transformers`, in the
trainer's dtype and attention, micro-batched as a trainer batches (right padding, an attention mask)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from replay.engine.config import device_problem
from replay.errors import CannotTestError, UsageError
from replay.trainer.rollouts import Rollout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = ("sdpa", "eager", "flash_attention_2")


def load_model(path: str, dtype: str, attention: str, device: str = "cpu") -> Any:
    """The checkpoint at `path` as a `transformers` causal LM, in eval mode on `device`."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if attention not in ATTENTION:
        raise UsageError(f"--attn {attention}: expected one of {', '.join(ATTENTION)}")
    check_device(device)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise CannotTestError("replay trainer scores with transformers, which is not installed: pip install "
                              "'vllm-replay[trainer]' (in a checkout: pip install -e '.[trainer]')") from None
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its loading bar would sit among our progress lines on stderr
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attention)
    except OSError as e:
        raise UsageError(f"--model {path}: not a checkpoint transformers can load ({str(e).splitlines()[0]})") from None
    except ImportError as e:  # an attention whose kernels are not installed here (flash-attn)
        raise CannotTestError(f"--attn {attention}: {str(e).splitlines()[0]}") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def check_device(device: str) -> None:
    """Raises UsageError, in one line, where the trainer's forward cannot run on `device` here."""
    if device != "cpu" and (problem := device_problem(device)):
        raise UsageError(f"--device {device}: {problem}")


def model_device(model: Any) -> torch.device:
    """Where the model's weights are (its inputs go there)."""
    return next(model.parameters()).device


def teacher_forced(model: Any, rollouts: list[Rollout], micro_batch: int, pack: bool = False
                   ) -> Iterator[tuple[Rollout, torch.Tensor, torch.Tensor | None]]:
    """Each rollout with its logits at the positions that predicted its generated tokens: [G, V] float32 on the
    model's device (the trainer casts before its log_softmax), and for a mixture of experts the experts its router
    picked for every token: [L, MoE layers, top-k] on the CPU (else None). Rollouts go `micro_batch` at a time,
    right-padded; with `pack`, each micro-batch is one row (position ids restarting per sequence, a block-diagonal
    causal mask), as trainers that remove padding run them."""
    routers = _routers(model)
    picked: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, a, o: picked.append(o[0] if isinstance(o, tuple) else o))
             for m in routers]
    try:
        yield from _batches(model, rollouts, micro_batch, pack, picked, routers)
    finally:
        for h in hooks:
            h.remove()


def _routers(model: Any) -> list[Any]:
    """The MoE routers of a transformers model, in layer order: the `gate` of each sparse block (`mlp.gate` in
    transformers 5, `block_sparse_moe.gate` before), a linear map to one logit per expert."""
    experts = getattr(model.config, "num_local_experts", None) or getattr(model.config, "num_experts", None)
    if not experts:
        return []
    return [m for n, m in model.named_modules() if n.endswith(".gate") and
            getattr(m, "weight", None) is not None and m.weight.shape[0] == experts]


def _batches(model: Any, rollouts: list[Rollout], micro_batch: int, pack: bool, picked: list[torch.Tensor],
             routers: list[Any]) -> Iterator[tuple[Rollout, torch.Tensor, torch.Tensor | None]]:
    top_k = getattr(model.config, "num_experts_per_tok", 0)
    device = model_device(model)
    attention = getattr(model.config, "_attn_implementation", None) or ""
    for first in range(0, len(rollouts), micro_batch):
        batch = rollouts[first:first + micro_batch]
        seqs = [r.prompt + r.tokens for r in batch]
        inputs, places, shape = _packed(seqs, "flash" not in attention) if pack else _padded(seqs)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        # the positions that predict a generated token: a trainer scores those alone (the prompt's logits over
        # the whole vocabulary would be most of the memory: [rows, width, V])
        keep = sorted({c for r, (_, start) in zip(batch, places)
                       for c in range(start + len(r.prompt) - 1, start + len(r.prompt) - 1 + len(r.tokens))})
        picked.clear()
        with torch.inference_mode():
            # (no KV cache: a trainer's forward keeps none, and transformers reads packing from the position ids
            # only without one)
            try:
                logits = model(**inputs, use_cache=False,
                               logits_to_keep=torch.tensor(keep, device=device)).logits  # [rows, keep, V]
            except TypeError:  # a model whose forward takes no logits_to_keep: every position
                picked.clear()
                logits = model(**inputs, use_cache=False).logits
            if logits.shape[1] != len(keep):  # (one that took it into **kwargs and computed every position)
                keep = list(range(shape[1]))
        column = {c: i for i, c in enumerate(keep)}
        experts = None
        if routers and len(picked) == len(routers):  # each router's logits: [rows * width, experts]
            experts = torch.stack([x.reshape(*shape, -1).topk(top_k, dim=-1).indices for x in picked],
                                  dim=2).cpu()  # [rows, width, MoE layers, top-k]
        for r, seq, (row, start) in zip(batch, seqs, places):
            first = column[start + len(r.prompt) - 1]  # its positions are consecutive in `keep`
            yield r, logits[row, first:first + len(r.tokens)].float(), \
                None if experts is None else experts[row, start:start + len(seq)]


def _padded(seqs: list[list[int]]) -> tuple[dict, list[tuple[int, int]], tuple[int, int]]:
    """One row per sequence, right-padded, with an attention mask: (the model's inputs, each sequence's (row,
    first column), (rows, width))."""
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}, [(i, 0) for i in range(len(seqs))], (len(seqs), width)


def _packed(seqs: list[list[int]], mask: bool = True) -> tuple[dict, list[tuple[int, int]], tuple[int, int]]:
    """Every sequence in one row, position ids restarting per sequence, and with `mask` a block-diagonal causal
    mask; without, transformers reads the sequences from the position ids, as padding-free trainers feed it for
    flash-attention's variable-length kernels. (For sdpa and eager it would build the same mask, bit for bit, more
    slowly.)"""
    starts = [sum(map(len, seqs[:i])) for i in range(len(seqs) + 1)]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    inputs = {"input_ids": torch.tensor([sum(seqs, [])]), "position_ids": pos[None]}
    if mask:
        width = starts[-1]
        seg = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(s) for s in seqs]))
        at = torch.arange(width)
        block = (seg[:, None] == seg[None, :]) & (at[:, None] >= at[None, :])  # [width, width]: causal, per sequence
        inputs["attention_mask"] = block[None, None]
    return inputs, [(0, x) for x in starts[:-1]], (1, starts[-1])
