"""Hugging Face models: packing, padding, decoding with the cache, generate(), save/load, conversion."""

from __future__ import annotations

import pytest
import torch

import attnkit  # noqa: F401  (registers the model type)
from attnkit.models import MIXERS, AttnKitCache, AttnKitConfig, AttnKitForCausalLM, from_llama
from tests.helpers import rel_rms

transformers = pytest.importorskip("transformers")


def tiny_config(mixer, **overrides) -> AttnKitConfig:
    gqa = mixer not in ("vla", "deltanet") and isinstance(mixer, str)
    settings = dict(
        vocab_size=61,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=4,
        num_kv_heads=2 if gqa else None,
        intermediate_size=48,
        mixer=mixer,
        backend="torch",
    )
    settings.update(overrides)
    return AttnKitConfig(**settings)


def tiny_model(mixer, **overrides) -> AttnKitForCausalLM:
    torch.manual_seed(0)
    model = AttnKitForCausalLM(tiny_config(mixer, **overrides)).eval()
    # fresh init is small; larger weights make every mixer's numerics matter in the comparisons
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


@pytest.mark.parametrize("mixer", MIXERS)
def test_padded_batch_equals_packed(mixer):
    model = tiny_model(mixer)
    lengths = [7, 3, 12]
    T = max(lengths)
    ids = torch.randint(1, 61, (3, T))
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = 1
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        packed_ids = torch.cat([ids[b, T - n :] for b, n in enumerate(lengths)])[None]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        packed = model(packed_ids, cu_seqlens=cu, use_cache=False).logits
    expected = packed[0]
    actual = torch.cat([padded[b, T - n :] for b, n in enumerate(lengths)])
    assert rel_rms(actual, expected) <= 1e-5


@pytest.mark.parametrize("prompt", [1, 9, 70], ids=lambda n: f"prompt{n}")
@pytest.mark.parametrize("mixer", MIXERS)
def test_prefill_then_decode_equals_full_forward(mixer, prompt):
    model = tiny_model(mixer)
    B, new = 2, 6
    ids = torch.randint(1, 61, (B, prompt + new))
    mask = torch.ones_like(ids)
    if prompt > 1:
        mask[1, : prompt // 2] = 0  # left padding in the prompt of the second sequence
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], use_cache=True)
        cache = out.cache
        assert isinstance(cache, AttnKitCache) and cache.get_seq_length() == prompt
        steps = [out.logits]
        for t in range(prompt, prompt + new):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    decoded = torch.cat(steps, dim=1)
    real = mask.bool()
    assert rel_rms(decoded[real], full[real]) <= 1e-4


@pytest.mark.parametrize("mixer", MIXERS)
def test_generate_with_cache_equals_recomputation(mixer):
    model = tiny_model(mixer)
    ids = torch.randint(1, 61, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        recomputed = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (2, 18)
    assert torch.equal(cached, recomputed)


def test_sampling_with_cache_is_seeded():
    model = tiny_model("path")
    ids = torch.randint(1, 61, (2, 5))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        with torch.no_grad():
            runs.append(model.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, pad_token_id=0))
    assert runs[0].shape == (2, 11) and torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("mixer", MIXERS)
def test_save_load_round_trip(mixer, tmp_path):
    model = tiny_model(mixer)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, AttnKitForCausalLM)
    ids = torch.randint(1, 61, (2, 13))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_hybrid_stack():
    model = tiny_model(["vla", "path", "vla"], num_hidden_layers=3)
    kinds = [type(block.attn).__name__ for block in model.model.layers]
    assert kinds == ["VLAAttention", "PaTHAttention", "VLAAttention"]
    ids = torch.randint(1, 61, (1, 20))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :12], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(12, 20):
            out = model(ids[:, t : t + 1], cache=cache)
            steps.append(out.logits)
            cache = out.cache
    assert rel_rms(torch.cat(steps, 1), full) <= 1e-4


def test_tied_embeddings():
    model = tiny_model("rope", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_loss_matches_cross_entropy():
    model = tiny_model("tapa")
    ids = torch.randint(1, 61, (2, 9))
    labels = ids.clone()
    labels[:, :3] = -100
    out = model(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    assert torch.allclose(out.loss, expected)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_auto_model_from_config_after_import():
    config = transformers.AutoConfig.for_model("attnkit", vocab_size=50, hidden_size=32, num_heads=2, mixer="vla")
    assert isinstance(config, AttnKitConfig)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert isinstance(model, AttnKitForCausalLM)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mixer="mamba"), "^mixer"),
        (dict(mixer=["path", "vla", "path"]), "^mixer"),
        (dict(num_kv_heads=3), "^num_kv_heads"),
        (dict(hidden_size=30), "^num_heads"),
        (dict(vocab_size=0), "^vocab_size"),
        (dict(num_hidden_layers=-1), "^num_hidden_layers"),
        (dict(backend="cuda"), "^backend"),
        (dict(mixer_kwargs={"path": 3}), "^mixer_kwargs"),
        (dict(rms_norm_eps=0.0), "^rms_norm_eps"),
        (dict(mixer=None), "^mixer"),
        (dict(rms_norm_eps=float("inf")), "^rms_norm_eps"),
        (dict(initializer_range=-0.02), "^initializer_range"),
        (dict(pad_token_id=61), "^pad_token_id"),
        (dict(eos_token_id=[1, 99]), "^eos_token_id"),
        (dict(max_position_embeddings=0), "^max_position_embeddings"),
    ],
    ids=["mixer", "mixer-list", "kv-heads", "hidden", "vocab", "layers", "backend", "mixer-kwargs", "eps", "mixer-none",
         "eps-inf", "init-range", "pad-id", "eos-ids", "max-positions"],  # fmt: skip
)
def test_bad_config(kwargs, match):
    settings = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=4)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=match):
        AttnKitConfig(**settings)


def tiny_llama(num_kv_heads=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_from_llama_with_rope_reproduces_llama():
    llama = tiny_llama()
    model = from_llama(llama, mixer="rope").eval()
    ids = torch.randint(1, 61, (2, 17))
    with torch.no_grad():
        assert rel_rms(model(ids).logits, llama(ids).logits) <= 1e-5


@pytest.mark.parametrize("mixer", ["path", "path_fox", "tapa", "vla"])
def test_from_llama_copies_weights(mixer):
    llama = tiny_llama()
    model = from_llama(llama, mixer=mixer).eval()
    src, dst = llama.model.layers[1], model.model.layers[1]
    assert torch.equal(dst.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(dst.attn.q_proj.weight, src.self_attn.q_proj.weight)
    if mixer == "vla":  # no GQA: every key head repeated for its query heads
        assert torch.equal(dst.attn.k_proj.weight[8:16], src.self_attn.k_proj.weight[:8])
    else:
        assert torch.equal(dst.attn.k_proj.weight, src.self_attn.k_proj.weight)
    ids = torch.randint(1, 61, (1, 9))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_compiled_forward_matches_eager():
    model = tiny_model(["rope", "path", "vla"], num_hidden_layers=3, num_kv_heads=None)
    ids = torch.randint(1, 61, (2, 11))
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model)(ids, use_cache=False).logits
    assert rel_rms(compiled, eager) <= 1e-5
