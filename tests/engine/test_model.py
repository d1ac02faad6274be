"""The builtin model against transformers (the oracle), plus weights, fingerprints, `tiny` and tokenizers.

The oracle tests build small random checkpoints with transformers, perturb every tensor (biases and norm weights
included, so none of them can be silently ignored), save them, load them with our loader and compare logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from replay.engine.config import ModelConfig
from replay.engine.model import CausalLM, ContiguousAttention
from replay.engine.tokenizer import ByteTokenizer, load_tokenizer
from replay.engine.weights import (
    TINY_CONFIG,
    load_checkpoint,
    load_model,
    load_model_config,
    tiny_model,
)
from replay.errors import UsageError
from replay.provenance import set_torch_threads

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
SEQS = [[5, 17, 200, 3, 99], [1, 250, 42, 42, 7, 128, 64, 0, 11, 33, 90]]  # two sequences, different lengths


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: timings and bits do not depend on a busy neighbour core."""
    before = torch.get_num_threads()
    set_torch_threads(1)
    yield
    set_torch_threads(before)


@pytest.fixture
def transformers():
    """The oracle; these tests skip where transformers is not installed."""
    return pytest.importorskip("transformers")


def save_hf(transformers, path, arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """A random transformers model of `arch` with every tensor perturbed, saved to `path`; returns the model."""
    cls_config = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = cls_config(**{**SMALL, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():  # zero biases and unit norms would hide a mapping mistake
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def our_logits(model: CausalLM, seqs: list[list[int]]) -> list[torch.Tensor]:
    """All sequences in one flattened batch through ContiguousAttention -> per-sequence logits [len, vocab]."""
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    ctx = ContiguousAttention([len(s) for s in seqs], sliding_window=model.cfg.sliding_window)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, ctx))
    return list(logits.split([len(s) for s in seqs]))


def hf_logits(hf_model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence alone through transformers -> per-sequence logits [len, vocab] float32."""
    with torch.no_grad():
        return [hf_model(torch.tensor([s])).logits[0].float() for s in seqs]


ORACLE_CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_rope_llama3": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama_rope_linear": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0,
                                                                   "factor": 4.0}}),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama_biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralForCausalLM", {}),
    "mistral_sliding_window": ("MistralForCausalLM", {"sliding_window": 3}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3_bias": ("Qwen3ForCausalLM", {"attention_bias": True}),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_float32_logits_match_transformers(transformers, tmp_path, case):
    arch, overrides = ORACLE_CASES[case]
    hf = save_hf(transformers, tmp_path, arch, **overrides)
    model, cfg, _ = load_checkpoint(tmp_path, torch.float32, "cpu")
    assert cfg.architecture == arch
    for ours, theirs in zip(our_logits(model, SEQS), hf_logits(hf, SEQS)):
        assert ours.dtype == torch.float32
        assert (ours - theirs).abs().max().item() < 1e-5


def test_checkpoint_config_is_read_per_architecture(transformers, tmp_path):
    save_hf(transformers, tmp_path / "qwen2", "Qwen2ForCausalLM")
    save_hf(transformers, tmp_path / "qwen3", "Qwen3ForCausalLM")
    save_hf(transformers, tmp_path / "llama3", "LlamaForCausalLM", **ORACLE_CASES["llama_rope_llama3"][1])
    qwen2, qwen3 = load_model_config(tmp_path / "qwen2"), load_model_config(tmp_path / "qwen3")
    assert qwen2.attention_bias and not qwen2.qk_norm  # Qwen2 has no attention_bias key, but always q/k/v bias
    assert qwen3.qk_norm and not qwen3.attention_bias
    llama3 = load_model_config(tmp_path / "llama3")
    assert llama3.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    assert llama3.rope_theta == 10000.0 and llama3.bos_token_id == 1 and llama3.eos_token_id == 2


def test_old_style_config_keys_are_understood(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None,
        "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}, "sliding_window": 4096}))
    cfg = load_model_config(tmp_path)
    assert cfg.head_dim == 16  # hidden_size // num_attention_heads when head_dim is absent or null
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.sliding_window == 4096 and not cfg.tie_word_embeddings


def test_bfloat16_load_is_close_to_float32(transformers, tmp_path):
    save_hf(transformers, tmp_path, "Qwen3ForCausalLM")
    m32, _, fp32 = load_checkpoint(tmp_path, torch.float32, "cpu")
    m16, _, fp16 = load_checkpoint(tmp_path, torch.bfloat16, "cpu")
    assert m16.dtype == torch.bfloat16 and m32.dtype == torch.float32
    assert fp16 == fp32  # the fingerprint is of the stored tensors, not of the requested dtype
    for a, b in zip(our_logits(m32, SEQS), our_logits(m16, SEQS)):
        assert b.dtype == torch.float32 and (a - b).abs().max().item() < 0.1


def test_fingerprint_is_stable_and_tracks_the_weights(transformers, tmp_path):
    save_hf(transformers, tmp_path / "a", "LlamaForCausalLM", seed=0)
    save_hf(transformers, tmp_path / "b", "LlamaForCausalLM", seed=1)
    _, _, a1 = load_checkpoint(tmp_path / "a", torch.float32, "cpu")
    _, _, a2 = load_checkpoint(tmp_path / "a", torch.float32, "cpu")
    _, _, b = load_checkpoint(tmp_path / "b", torch.float32, "cpu")
    assert a1 == a2 and len(a1) == 64
    assert a1 != b


def test_sharded_checkpoint_loads_with_the_same_weights_and_fingerprint(transformers, tmp_path):
    save_hf(transformers, tmp_path / "one", "Qwen2ForCausalLM", seed=3)
    hf = save_hf(transformers, tmp_path / "shards", "Qwen2ForCausalLM", seed=3, max_shard_size="50KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    sharded, _, fp_sharded = load_checkpoint(tmp_path / "shards", torch.float32, "cpu")
    _, _, fp_one = load_checkpoint(tmp_path / "one", torch.float32, "cpu")
    assert fp_sharded == fp_one
    for ours, theirs in zip(our_logits(sharded, SEQS), hf_logits(hf, SEQS)):
        assert (ours - theirs).abs().max().item() < 1e-5


def test_missing_and_unexpected_tensors_are_usage_errors_naming_them(transformers, tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf(transformers, tmp_path, "LlamaForCausalLM")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(UsageError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, file)
    with pytest.raises(UsageError, match=r"unexpected.*model\.layers\.1\.mlp\.extra\.weight"):
        load_checkpoint(tmp_path, torch.float32, "cpu")


def test_tied_checkpoint_shares_embedding_and_head(transformers, tmp_path):
    save_hf(transformers, tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)
    model, cfg, _ = load_checkpoint(tmp_path, torch.float32, "cpu")
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight


def test_unsupported_architecture_is_a_usage_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(UsageError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path))


def test_unsupported_rope_type_is_a_usage_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(UsageError, match="yarn"):
        load_model_config(tmp_path)


def test_load_model_rejects_bad_names_in_one_line(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    for bad, why in [(tmp_path / "nope", "not found"), (tmp_path / "file.txt", "not a directory"),
                     (tmp_path / "empty", "no config.json")]:
        with pytest.raises(UsageError, match=why) as e:
            load_model(str(bad))
        assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="dtype"):
        load_model("tiny", dtype="int8")


def test_checkpoint_without_safetensors_is_a_usage_error(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], **SMALL}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_module_names_are_the_hook_contract():
    names = {n for n, _ in CausalLM(TINY_CONFIG, device="meta").named_modules()}
    for expected in ["embed_tokens", "norm", "lm_head", "layers.3.input_layernorm", "layers.3.post_attention_layernorm",
                     "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj",
                     "layers.0.self_attn.o_proj", "layers.0.self_attn.attn", "layers.0.mlp.gate_proj",
                     "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"]:
        assert expected in names
    assert not any("q_norm" in n for n in names)  # q/k norm only where the architecture has it
    qwen3 = ModelConfig(**{**{f: getattr(TINY_CONFIG, f) for f in TINY_CONFIG.__slots__},
                           "architecture": "Qwen3ForCausalLM", "qk_norm": True})
    names = {n for n, _ in CausalLM(qwen3, device="meta").named_modules()}
    assert {"layers.1.self_attn.q_norm", "layers.1.self_attn.k_norm"} <= names


def test_attention_module_output_is_visible_to_hooks():
    model, _, _ = tiny_model()
    seen = {}
    model.get_submodule("layers.2.self_attn.attn").register_forward_hook(lambda m, i, o: seen.update(out=o))
    model(torch.tensor([1, 50, 60]), torch.arange(3), ContiguousAttention([3]))
    assert seen["out"].shape == (3, 4, 32)  # [N, num_heads, head_dim]


def test_batched_sequences_match_each_alone():
    model, _, _ = tiny_model()
    batched = our_logits(model, SEQS)
    for seq, b in zip(SEQS, batched):
        (alone,) = our_logits(model, [seq])
        assert torch.allclose(alone, b, atol=1e-5, rtol=0)


def test_tiny_model_is_deterministic_across_calls_and_dtypes():
    rng = torch.random.get_rng_state()
    a, cfg, fp_a = tiny_model(torch.float32)
    b, _, fp_b = tiny_model(torch.float32)
    c, _, fp_c = tiny_model(torch.bfloat16)
    assert torch.equal(rng, torch.random.get_rng_state())  # the global RNG is never used
    assert cfg == TINY_CONFIG and cfg.vocab_size == 512 and cfg.num_hidden_layers == 4
    assert fp_a == fp_b == fp_c
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa.to(torch.bfloat16), pc), name
    _, _, fp_named = load_model("tiny", "float32", "cpu")
    assert fp_named == fp_a


def test_tiny_fingerprint_is_what_its_saved_checkpoint_reports(tmp_path):
    from safetensors.torch import save_file

    model, cfg, fp = tiny_model()
    tensors = {(n if n.startswith("lm_head") else f"model.{n}"): p.contiguous() for n, p in model.named_parameters()}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [cfg.architecture], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "bos_token_id": 1, "eos_token_id": 2}))
    loaded, loaded_cfg, loaded_fp = load_checkpoint(tmp_path, torch.float32, "cpu")
    assert loaded_fp == fp and loaded_cfg == cfg
    assert torch.equal(our_logits(loaded, SEQS)[1], our_logits(model, SEQS)[1])


def greedy(model: CausalLM, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation, recomputing the whole sequence every step (no cache needed)."""
    ids = list(ids)
    for _ in range(steps):
        (logits,) = our_logits(model, [ids])
        ids.append(int(logits[-1].argmax()))
    return ids[-steps:]


def test_tiny_greedy_continuations_are_not_constant():
    model, _, _ = tiny_model()
    tok = ByteTokenizer()
    outs = [greedy(model, tok.encode(p), 12) for p in ["Hello", "The quick brown fox", "1 2 3"]]
    assert all(len(set(o)) > 3 for o in outs), outs  # no prompt settles on one repeated token
    assert len({tuple(o) for o in outs}) == 3  # and the prompts lead to different places
    # the context matters, not only the last token (a wrong KV block must be able to change the output)
    assert greedy(model, tok.encode("hello world"), 4) != greedy(model, tok.encode("jolly mold"), 4)


def test_byte_tokenizer_round_trips_text_and_skips_specials():
    tok = ByteTokenizer()
    text = "héllo, wörld — 🙂\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert max(ids) < TINY_CONFIG.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode([1, 3 + ord("a"), 2, 0, 400, 3 + ord("b")]) == "ab"
    assert tok.decode([3 + 0xFF, 3 + ord("z")]) == "\ufffdz"  # invalid UTF-8 is replaced, not raised


def test_load_tokenizer_per_model_kind(tmp_path):
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer.json: only token-id prompts
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([0, 3, 4, 1]) == "hello world"
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
