"""Weights for the builtin engine: Hugging Face checkpoint directories (config.json + safetensors) and `tiny`.

Every model comes with a *weights fingerprint* (`replay.provenance.weights`) that goes into the capture header, so
replay can tell "same weights" from "same name". This module also owns the dtype names the builtin engine
accepts, for recording and for replay alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from replay.engine.config import DTYPES as DTYPE_NAMES
from replay.engine.config import ModelConfig
from replay.engine.model import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, CausalLM
from replay.errors import UsageError
from replay.provenance.weights import Fingerprint, read_json, safetensors_files

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the dtype names of engine.config, as torch dtypes


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name; any other name is a UsageError listing the supported ones."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}") from None

# The builtin model. Its tokenizer is `ByteTokenizer` (ids 0-2 specials, 3-258 bytes; the rest of the vocab is
# never produced by encode, which keeps room for specials later without changing the weights).
TINY_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
TINY_SEED = 20251130  # changing it changes every tiny capture's fingerprint: don't
# Init scales, chosen by measurement (greedy continuations of a few prompts, logit spread, and how often changing
# an early token changes later argmaxes). With N(0, 0.02) everywhere the logits are nearly flat and greedy decoding
# repeats one token; with only the embeddings widened the layers add ~5 % to the residual stream and the next token
# depends on the last token alone, which would hide KV-cache bugs from a reference model. So: unit embeddings,
# projections N(0, 1/fan_in) (the residual stream keeps its scale and attention is sharp enough to matter), and a
# head that gives logits of std ~3 (top-1 probability ~0.2: sampling is not merely greedy).
TINY_EMBED_STD = 1.0
TINY_LM_HEAD_STD = 0.25


def _hf_name(ours: str) -> str:
    """Our parameter name -> the checkpoint's (`layers.0.mlp.up_proj.weight` -> `model.layers.0.mlp.up_proj.weight`)."""
    return ours if ours.startswith("lm_head.") else f"model.{ours}"


def _checkpoint_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"model {str(path)!r} not found: give `tiny` or a local checkpoint directory")
    if not p.is_dir():
        raise UsageError(f"model {str(path)!r} is not a directory: give `tiny` or a local checkpoint directory")
    if not (p / "config.json").is_file():
        raise UsageError(f"{p} has no config.json: not a Hugging Face checkpoint directory")
    return p


def _rope(cfg: dict[str, Any], where: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UsageError(f"{where}: unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    need = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}[rope_type]
    if missing := [k for k in need if k not in params]:
        raise UsageError(f"{where}: rope_type {rope_type!r} needs {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **params}


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a checkpoint directory's config.json into a `ModelConfig`; unsupported models raise `UsageError`."""
    where = _checkpoint_dir(path) / "config.json"
    cfg = read_json(where)
    archs = cfg.get("architectures") or [None]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UsageError(f"{where}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UsageError(f"{where}: unsupported hidden_act {cfg['hidden_act']!r}; only silu is supported")
    qwen = arch.startswith("Qwen")
    if qwen and cfg.get("use_sliding_window"):
        raise UsageError(f"{where}: Qwen sliding-window attention (use_sliding_window) is not supported")
    theta, scaling = _rope(cfg, where)
    # Qwen2 configs carry no attention_bias key, but Qwen2 always biases q/k/v; Mistral never has biases
    attention_bias = arch == "Qwen2ForCausalLM" or (arch != "MistralForCausalLM" and bool(cfg.get("attention_bias")))
    try:
        heads = int(cfg["num_attention_heads"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None,
        )
    except KeyError as e:
        raise UsageError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: bad value ({e})") from None


def _names(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_checkpoint(path: str | Path, dtype: torch.dtype,
                    device: str | torch.device) -> tuple[CausalLM, ModelConfig, str]:
    """Load a checkpoint directory (single or sharded safetensors) -> (model, config, weights fingerprint).

    Tensors are read one at a time and converted to `dtype` on `device`, so peak host memory is one tensor.
    Every parameter must come from the files (a tied lm_head may be absent); anything left over is an error.
    """
    from safetensors import safe_open  # lazily: only checkpoint loading needs it

    d = Path(path)
    cfg = load_model_config(d)
    files = safetensors_files(d)
    model = CausalLM(cfg, dtype, device)
    params = {_hf_name(n): p for n, p in model.named_parameters()}  # tied lm_head is a duplicate: not listed
    loaded: set[str] = set()
    unexpected: list[str] = []
    fp = Fingerprint()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    fp.add(name, t)
                    if name in params:
                        if tuple(t.shape) != tuple(params[name].shape):
                            want = list(params[name].shape)
                            raise UsageError(f"{f}: {name} has shape {list(t.shape)}, config.json implies {want}")
                        with torch.no_grad():
                            params[name].copy_(t)
                        loaded.add(name)
                    elif name == "lm_head.weight" and cfg.tie_word_embeddings:
                        pass  # tied: the head is embed_tokens, as transformers does it
                    elif name.endswith("rotary_emb.inv_freq"):
                        pass  # old checkpoints saved the RoPE table; we compute it
                    else:
                        unexpected.append(name)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise UsageError(f"{f}: cannot read safetensors ({e})") from None
    if missing := sorted(set(params) - loaded):
        raise UsageError(f"{d}: tensors missing from the checkpoint: {_names(missing)}")
    if unexpected:
        raise UsageError(f"{d}: unexpected tensors in the checkpoint: {_names(sorted(unexpected))}")
    return model, cfg, fp.hexdigest()


def tiny_model(dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[CausalLM, ModelConfig, str]:
    """The builtin `tiny` model -> (model, config, fingerprint), the same values for every dtype and device.

    Weights are drawn in float32 on CPU from a private generator seeded with `TINY_SEED`, then converted; the
    fingerprint is that of the float32 tensors under their Hugging Face names, i.e. what saving `tiny` as a
    float32 checkpoint and loading it back would report.
    """
    cfg = TINY_CONFIG
    model = CausalLM(cfg, dtype, device)
    g = torch.Generator(device="cpu").manual_seed(TINY_SEED)
    fp = Fingerprint()
    for name, p in model.named_parameters():  # fixed order: the order of construction
        if name.endswith("norm.weight"):
            w = torch.ones(p.shape)
        else:
            if name == "embed_tokens.weight":
                std = TINY_EMBED_STD
            elif name == "lm_head.weight":
                std = TINY_LM_HEAD_STD
            else:  # a projection [out, in] (or its bias, which tiny has none of)
                std = p.shape[-1] ** -0.5
            w = torch.randn(p.shape, generator=g) * std
        fp.add(_hf_name(name), w)
        with torch.no_grad():
            p.copy_(w)
    return model, cfg, fp.hexdigest()


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu") -> tuple[CausalLM, ModelConfig, str]:
    """`tiny` (the builtin model; write `./tiny` for a directory of that name) or a checkpoint directory ->
    (model, config, weights fingerprint). `dtype` is one of float32 | bfloat16 | float16 | float64."""
    dt = torch_dtype(dtype)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}") from None
    if name_or_path == "tiny":
        return tiny_model(dt, dev)
    return load_checkpoint(_checkpoint_dir(name_or_path), dt, dev)


def load_model_config_for(name_or_path: str) -> ModelConfig:
    """The ModelConfig of "tiny" or of a checkpoint directory, without loading any weights."""
    return TINY_CONFIG if name_or_path == "tiny" else load_model_config(name_or_path)

