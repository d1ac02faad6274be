"""The builtin engine's model: one Llama-family decoder for Llama, Mistral, Qwen2 and Qwen3 checkpoints.

Tokens arrive flattened the vLLM way: every scheduled token of every request is one row of `[N, hidden]`, and
only attention knows which rows belong together. That knowledge lives in an *attention context* passed to
`forward`, with one method, `attend(layer_idx, q, k, v) -> out`; `ContiguousAttention` below handles whole,
independent sequences, and the runner's paged-KV context implements the same protocol.

The arithmetic follows Hugging Face transformers step for step (RMSNorm in float32, RoPE tables in float32 cast
to the model dtype, residual order), so float32 logits agree with `transformers` to ~1e-6 and the oracle tests
can hold us to it. Module names are a contract: `bisect layers` finds its hooks by them.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from replay.engine.config import ModelConfig
from replay.errors import UsageError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class AttentionContext(Protocol):
    """What `CausalLM.forward` needs from whoever knows how the batch is arranged (contiguous sequences, paged
    cache...)."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, num_heads, head_dim], k/v [N, num_kv_heads, head_dim] (RoPE applied) -> [N, num_heads, head_dim]."""
        ...


class ContiguousAttention:
    """Causal attention over whole, independent sequences laid end to end (sequence 0's tokens first); no cache.

    `sliding_window` (Mistral) limits each query to the last `sliding_window` keys, as transformers does.
    """

    def __init__(self, seq_lens: list[int], sliding_window: int | None = None):
        if any(n <= 0 for n in seq_lens):
            raise ValueError(f"sequence lengths must be positive, got {seq_lens}")
        self.seq_lens = list(seq_lens)
        self.sliding_window = sliding_window

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend within each sequence; returns [N, num_heads, head_dim]."""
        if sum(self.seq_lens) != q.shape[0]:
            raise ValueError(f"seq_lens {self.seq_lens} do not add up to the {q.shape[0]} tokens given")
        groups = q.shape[1] // k.shape[1]  # GQA: query heads per kv head
        outs = []
        for qs, ks, vs in zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)):
            n = qs.shape[0]
            # [n, heads, D] -> [heads, n, D]; kv head j serves query heads j*groups .. (j+1)*groups-1
            qs = qs.transpose(0, 1)
            ks = ks.repeat_interleave(groups, dim=1).transpose(0, 1)
            vs = vs.repeat_interleave(groups, dim=1).transpose(0, 1)
            scale = 1.0 / math.sqrt(q.shape[-1])
            if self.sliding_window is not None and self.sliding_window < n:
                i = torch.arange(n, device=q.device)
                d = i[:, None] - i[None, :]  # query index - key index
                mask = (d >= 0) & (d < self.sliding_window)  # [n, n], True = may attend
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            outs.append(o.transpose(0, 1))  # back to [n, heads, D]
        return torch.cat(outs)


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2], float32 on CPU, for the config's rope type (default|linear|llama3)."""
    dim = cfg.head_dim
    # int64 arange then float, exactly as transformers does, so the tables agree to the last bit
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = cfg.rope_scaling or {}
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params.get("original_max_position_embeddings", cfg.max_position_embeddings)
        low_wavelen, high_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UsageError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1), the half-split RoPE convention of HF checkpoints."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Calls the attention context; a module of its own so that forward hooks can see attention output."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_ctx: AttentionContext) -> torch.Tensor:
        """q [N, H, D], k/v [N, KV, D] -> [N, H, D]."""
        return attn_ctx.attend(self.layer_idx, q, k, v)


class SelfAttention(nn.Module):
    """q/k/v projections, optional per-head q/k norm (Qwen3), RoPE, the attention context, o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        # Qwen2 biases q/k/v only; Llama's and Qwen3's `attention_bias` also covers o_proj
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)  # over head_dim, shared by all heads
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(layer_idx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_ctx: AttentionContext) -> torch.Tensor:
        """x [N, hidden], cos/sin [N, 1, D] -> [N, hidden]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [N, H, D]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KV, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KV, D]
        if self.qk_norm:  # Qwen3 normalises before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = self.attn(q, k, v, attn_ctx)  # [N, H, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_ctx: AttentionContext) -> torch.Tensor:
        """h [N, hidden] -> [N, hidden]."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn_ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    """A Llama-family decoder over flattened tokens.

    Built with *uninitialised* parameters on `device` (construction goes through the meta device, so it neither
    spends time on an init nor touches the global RNG); `replay.engine.weights` fills them.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        if cfg.architecture not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UsageError(f"unsupported architecture {cfg.architecture!r}; supported: {supported}")
        self.cfg = cfg
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype)  # still on meta: free
        self.to_empty(device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one Parameter, two names
        self.requires_grad_(False)
        self.eval()
        # A plain attribute, not a buffer, so that `.to(bfloat16)` cannot round the frequencies.
        self.inv_freq = rope_inv_freq(cfg).to(device)  # [D/2] float32

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights and activations (float32 | bfloat16 | float16 | float64)."""
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions [N] (int64) -> hidden states [N, hidden], after the final norm."""
        h = self.embed_tokens(input_ids)  # [N, hidden]
        # RoPE tables in float32, then cast to the model dtype (as transformers does)
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [N, 1, D], broadcast over heads
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, attn_ctx)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] in float32."""
        return self.lm_head(hidden).float()
