"""GPT-2 loader: our Flax GPT-2 matches transformers' GPT2LMHeadModel on the same weights."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import hf_gpt2, registry  # noqa: E402
from models.config import ConfigError  # noqa: E402
from models.model import Model  # noqa: E402

TOL = 1e-4
PROMPT_LEN = 11
DECODE_STEPS = 6


def _tiny_hf_gpt2(n_layer: int = 2, n_embd: int = 64, seed: int = 0):
    """A random GPT2LMHeadModel whose every parameter (norms and biases too) is non-trivial."""
    cfg = transformers.GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=4, vocab_size=256,
                                  n_positions=128, bos_token_id=255, eos_token_id=255)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or "ln_f.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("wte.weight"):  # also the tied LM head: O(1) logits
                p.copy_(torch.randn_like(p))
            elif name.endswith("wpe.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[0]))
    return model.eval()


def _save(model, path) -> str:
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens)[None], dtype=torch.long)).logits[0].numpy()


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = _tiny_hf_gpt2()
    path = _save(hf, tmp_path_factory.mktemp("gpt2_tiny"))
    tokens = np.random.default_rng(0).integers(0, 256, PROMPT_LEN + DECODE_STEPS)
    return hf, path, tokens, _torch_logits(hf, tokens)


def test_checkpoint_is_nontrivial(checkpoint):
    _, _, _, ref = checkpoint
    assert np.std(ref) > 2.0, "reference logits too small for a meaningful comparison"


def test_config_from_saved_checkpoint(checkpoint):
    _, path, _, _ = checkpoint
    loaded = hf_gpt2.load(path)
    cfg = loaded.model.cfg
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "gpt2", 64, 2, 4, 4)
    assert (cfg.vocab_size, cfg.max_position, cfg.intermediate_size) == (256, 128, 256)
    assert cfg.activation == "gelu_tanh" and cfg.tie_embeddings
    # Same tree structure and shapes as freshly initialised parameters.
    fresh = Model(cfg).init_params(seed=0)
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(loaded.params)
    for a, b in zip(jax.tree_util.tree_leaves(fresh), jax.tree_util.tree_leaves(loaded.params)):
        assert a.shape == b.shape and b.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(loaded.params["lm_head"]["kernel"]),
                                  np.asarray(loaded.params["embed"]["embedding"]).T)


def test_forward_matches_transformers(checkpoint):
    _, path, tokens, ref = checkpoint
    loaded = hf_gpt2.load(path)
    logits = loaded.model.forward(loaded.params, tokens)
    err = _max_err(logits, ref)
    print(f"gpt2 forward max |dlogit| = {err:.2e}")
    assert err <= TOL


def test_prefill_and_decode_match_transformers(checkpoint):
    _, path, tokens, ref = checkpoint
    loaded = hf_gpt2.load(path)
    model, params = loaded.model, loaded.params
    cache = model.init_cache(PROMPT_LEN + DECODE_STEPS)
    logits, cache, aux = model.prefill(params, tokens[:PROMPT_LEN], cache, all_logits=True)
    assert aux.prompt_len == PROMPT_LEN
    errs = {"prefill": _max_err(logits, ref[:PROMPT_LEN])}
    last, _, _ = model.prefill(params, tokens[:PROMPT_LEN], model.init_cache(PROMPT_LEN))
    errs["prefill_last"] = _max_err(last, ref[PROMPT_LEN - 1])
    for step in range(DECODE_STEPS):
        pos = PROMPT_LEN + step
        logits, cache = model.decode_step(params, int(tokens[pos]), pos, cache)
        errs[f"decode_{step}"] = _max_err(logits, ref[pos])
    print("gpt2 max |dlogit|:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL, errs


def test_num_layers_truncates(checkpoint):
    hf, path, tokens, _ = checkpoint
    loaded = hf_gpt2.load(path, num_layers=1)
    assert loaded.model.cfg.num_layers == 1
    assert "layers_1" not in loaded.params
    # Reference: the same weights in a one-layer transformers model.
    one = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=128,
        bos_token_id=255, eos_token_id=255))
    missing, _ = one.load_state_dict(hf.state_dict(), strict=False)
    assert not [k for k in missing if not k.endswith("attn.bias")]
    ref = _torch_logits(one.eval(), tokens)
    assert _max_err(loaded.model.forward(loaded.params, tokens), ref) <= TOL
    with pytest.raises(ConfigError, match=r"num_layers=3 must be in \[1, 2\]"):
        hf_gpt2.load(path, num_layers=3)


def test_direct_safetensors_path(checkpoint):
    _, path, tokens, ref = checkpoint
    loaded = hf_gpt2.load(os.path.join(path, "model.safetensors"))
    assert _max_err(loaded.model.forward(loaded.params, tokens), ref) <= TOL
    assert loaded.tokenizer is None


def test_state_dict_without_prefix(checkpoint):
    hf, path, tokens, ref = checkpoint
    cfg = hf_gpt2.load(path).model.cfg
    state = {k.removeprefix("transformer."): v.numpy() for k, v in hf.state_dict().items()}
    state["h.0.attn.bias"] = np.ones((1, 1, 128, 128), np.float32)  # old mask buffers are ignored
    state["h.0.attn.masked_bias"] = np.asarray(-1e4, np.float32)
    params = hf_gpt2.params_from_state_dict(state, cfg)
    assert _max_err(Model(cfg).forward(params, tokens), ref) <= TOL


def test_pytorch_bin_checkpoint(checkpoint, tmp_path):
    hf, path, tokens, ref = checkpoint
    torch.save({k: v.clone() for k, v in hf.state_dict().items()}, tmp_path / "pytorch_model.bin")
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    loaded = hf_gpt2.load(tmp_path)
    assert _max_err(loaded.model.forward(loaded.params, tokens), ref) <= TOL


def test_registry_loads_checkpoint(tmp_path):
    # 12 layers, so the registry's default "gpt2" num_layers (12) applies as is.
    hf = _tiny_hf_gpt2(n_layer=12, n_embd=32, seed=1)
    path = _save(hf, tmp_path)
    tokens = np.arange(9) * 7 % 256
    loaded = registry.load("gpt2", weights_path=path)
    assert loaded.model.cfg.num_layers == 12 and loaded.model.cfg.hidden_size == 32
    assert _max_err(loaded.model.forward(loaded.params, tokens), _torch_logits(hf, tokens)) <= TOL
    truncated = registry.load("gpt2", weights_path=path, num_layers=3)
    assert truncated.model.cfg.num_layers == 3 and "layers_3" not in truncated.params


def test_registry_without_weights_is_random_gpt2_small():
    loaded = registry.load("gpt2")
    cfg = loaded.model.cfg
    assert cfg == registry.GPT2
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.vocab_size) == (768, 12, 12, 50257)
    p = loaded.params
    assert p["embed"]["embedding"].shape == (50257, 768)
    assert p["pos_embed"]["embedding"].shape == (1024, 768)
    assert p["layers_11"]["qkv_proj"]["kernel"].shape == (768, 2304)
    assert p["layers_0"]["fc_in"]["kernel"].shape == (768, 3072)
    assert p["lm_head"]["kernel"].shape == (768, 50257)
    assert loaded.tokenizer is None


def test_tokenizer_json_is_wrapped(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the capital of France is Paris."] * 20, trainer)
    hf = _tiny_hf_gpt2()
    _save(hf, tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    t = hf_gpt2.load(tmp_path).tokenizer
    assert t is not None
    assert t.eos_id == tok.token_to_id("<|endoftext|>") and t.stop_ids == (t.eos_id,)
    ids = t.encode("hello world")
    assert ids and all(isinstance(i, int) for i in ids)
    assert t.decode(ids) == "hello world"
    assert t.apply_chat_template("hello world") == "hello world"
    assert t.apply_chat_template([{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "hi"}]) == "be brief\n\nhi"
    assert t.encode_chat("hello world") == ids
    assert t.encode_chat("world", system="hello") == t.encode("hello\n\nworld")
    with_eos = ids + [t.eos_id]
    assert t.decode(with_eos) == "hello world"
    assert t.decode(with_eos, skip_special=False) == "hello world<|endoftext|>"


# ----- errors -----------------------------------------------------------------------------
def _drop_c_fc(state):
    del state["transformer.h.1.mlp.c_fc.weight"]


def _transpose_c_attn(state):
    name = "transformer.h.0.attn.c_attn.weight"
    state[name] = state[name].T


@pytest.mark.parametrize("corrupt,message", [
    (_drop_c_fc, r"missing tensor 'transformer\.h\.1\.mlp\.c_fc\.weight' "
                 r"\(expected shape \(64, 256\)\)"),
    (_transpose_c_attn, r"'transformer\.h\.0\.attn\.c_attn\.weight' has shape "
                        r"\(192, 64\), expected \(64, 192\)"),
])
def test_bad_tensor_is_named(checkpoint, corrupt, message):
    hf, path, _, _ = checkpoint
    cfg = hf_gpt2.load(path).model.cfg
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    corrupt(state)
    with pytest.raises(ValueError, match=message):
        hf_gpt2.params_from_state_dict(state, cfg)


def test_not_a_gpt2_state_dict(checkpoint):
    _, path, _, _ = checkpoint
    cfg = hf_gpt2.load(path).model.cfg
    with pytest.raises(ValueError, match="transformer.wte.weight"):
        hf_gpt2.params_from_state_dict({"model.embed_tokens.weight": np.zeros((256, 64))}, cfg)


def test_missing_files(tmp_path, checkpoint):
    _, path, _, _ = checkpoint
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_gpt2.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no weights in"):
        hf_gpt2.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(open(os.path.join(path, "model.safetensors"),
                                                      "rb").read())
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_gpt2.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_gpt2.load(tmp_path / "model.safetensors")


def test_bad_config():
    base = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
            "vocab_size": 256, "activation_function": "gelu_new", "n_inner": None}
    cfg = hf_gpt2.config_from_hf(base)
    assert cfg.intermediate_size == 256 and cfg.activation == "gelu_tanh"
    assert hf_gpt2.config_from_hf({**base, "n_inner": 100}).intermediate_size == 100
    with pytest.raises(ConfigError, match="lacks n_head"):
        hf_gpt2.config_from_hf({k: v for k, v in base.items() if k != "n_head"})
    with pytest.raises(ConfigError, match="model_type='llama'"):
        hf_gpt2.config_from_hf({**base, "model_type": "llama"})
    with pytest.raises(ConfigError, match="activation_function='relu'"):
        hf_gpt2.config_from_hf({**base, "activation_function": "relu"})
    with pytest.raises(ConfigError, match="not divisible by num_heads"):
        hf_gpt2.config_from_hf({**base, "n_head": 5})


def test_config_json_roundtrip(checkpoint):
    _, path, _, _ = checkpoint
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    assert hf_gpt2.config_from_hf(hf_config) == hf_gpt2.load(path).model.cfg
