"""Tiny random-weight checkpoints for the real-vLLM tests and the README, written with `transformers` (nothing is
downloaded). `python -m testbed.checkpoints DIR` writes the README's `./my-qwen`.

vLLM's CPU attention needs head_dim >= 32; a small byte-level BPE tokenizer (trained here on a few sentences) is
added where a test needs text or structured output (xgrammar builds its token table from it).
"""

from __future__ import annotations

from pathlib import Path


def tiny_llama(path: Path, *, seed: int = 0, heads: int = 4, head_dim: int = 32, intermediate: int = 256) -> Path:
    """A 2-layer Llama (GQA 4/2 heads, head_dim 32, vocab 1024); other widths with `heads`, `head_dim` (hidden =
    heads x head_dim, half as many K/V heads) and `intermediate`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=heads * head_dim, num_hidden_layers=2, num_attention_heads=heads,
                                   num_key_value_heads=heads // 2, intermediate_size=intermediate, vocab_size=1024,
                                   head_dim=head_dim, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def tiny_qwen3(path: Path) -> Path:
    """A 2-layer Qwen3 (q/k norms, GQA 4/2 heads, head_dim 32, tied embeddings, vocab 1024)."""
    import torch
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=256, vocab_size=1024, head_dim=32, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                                   max_position_embeddings=512)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def tiny_mixtral(path: Path) -> Path:
    """A 2-layer Mixtral: 4 experts, top-2 routing (MoE), GQA 4/2 heads, head_dim 32, vocab 1024."""
    import torch
    import transformers

    torch.manual_seed(3)
    cfg = transformers.MixtralConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=32, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                     vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                     tie_word_embeddings=False, max_position_embeddings=512)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return path


def real_vocab_qwen2(path: Path, heads: int = 2, kv_heads: int = 1, layers: int = 2) -> Path:
    """A narrow Qwen2 (`layers` layers, 2 by default) with Qwen2.5's real vocabulary (151,936 ids; GQA 2/1 heads of
    32, hidden 64, tied embeddings, 40 MB): rank ties and near-ties among the logits only show at a real vocabulary
    size. `heads=4, kv_heads=2` (hidden 128) splits evenly over two tensor-parallel ranks."""
    import torch
    import transformers

    torch.manual_seed(2)
    cfg = transformers.Qwen2Config(hidden_size=32 * heads, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads,
                                   intermediate_size=128, vocab_size=151_936, head_dim=32, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                                   max_position_embeddings=512)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def add_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer (about 300 tokens, ids below the model's vocab) saved next to the weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the answer is yes", "the answer is no", '{"name": "x", "age": 12}', "0123456789 true false null"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 50, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
    return path


def lora_adapter(base: Path, path: Path, seed: int = 0, rank: int = 8) -> Path:
    """A random LoRA adapter for `base` in peft's format (adapter_config.json + adapter_model.safetensors, r=`rank`,
    lora_alpha 16, on q_proj and v_proj), written directly: what `peft`'s `save_pretrained` writes."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, out in (("q_proj", heads * hd), ("v_proj", kv * hd)):
            p = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[p + ".lora_A.weight"] = torch.randn(rank, h, generator=g) * 0.1
            tensors[p + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(base)}))
    return path


def tiny_mistral(path: Path, sliding_window: int = 32) -> Path:
    """A 2-layer Mistral with a sliding attention window of `sliding_window` tokens (GQA 4/2, head_dim 32)."""
    import torch
    import transformers

    torch.manual_seed(2)
    cfg = transformers.MistralConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=256, vocab_size=1024, head_dim=32, bos_token_id=1,
                                     eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                                     sliding_window=sliding_window, max_position_embeddings=512)
    transformers.MistralForCausalLM(cfg).save_pretrained(path)
    return path


def tiny_eagle_head(base: Path, path: Path) -> Path:
    """A random EAGLE draft head for `base` (a Llama), in the layout vLLM's `EagleLlamaForCausalLM` loads: one
    decoder layer without its input norm, and `fc` ([hidden, 2 x hidden]: token embedding + target hidden state);
    the embedding and LM head are shared with the target."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    torch.manual_seed(5)
    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "model_type", "dtype",
                                                      "torch_dtype")}
    layer = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keep)).model.layers[0]
    tensors = {f"layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items() if "input_layernorm" not in k}
    tensors["fc.weight"] = torch.randn(cfg["hidden_size"], 2 * cfg["hidden_size"]) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def wide_llama(path: Path) -> Path:
    """A 2-layer Llama wide enough for float32 batch variance on vLLM's CPU kernels (hidden 512, GQA 8/4 heads,
    head_dim 64, intermediate 2048, vocab 1024; 40 MB): a decode computed alone takes another GEMM path than in a
    batch (M = 1 against M >= 2: docs/guide.md, `bisect batch`). The 128-wide `tiny_llama` is batch-invariant there."""
    return tiny_llama(path, seed=3, heads=8, head_dim=64, intermediate=2048)


if __name__ == "__main__":  # `python -m testbed.checkpoints ./my-qwen`: the README's checkpoint, with its tokenizer
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m testbed.checkpoints DIR  (a random Qwen2 at Qwen2.5's vocabulary, with a tokenizer)")
    print(add_tokenizer(real_vocab_qwen2(Path(sys.argv[1]))))
