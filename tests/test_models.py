"""Model-agnostic behaviour of `Model`: cache consistency, compile reuse, input validation,
and LLaMA (with GQA) against transformers' LlamaForCausalLM."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import model as model_mod
from models import registry
from models.config import ConfigError, ModelConfig
from models.model import Model, tie_lm_head
from mpcache_jax.policy import FULL

TOL = 1e-4
TINY = ("llama-tiny", "gpt2-tiny")
PROMPT_LEN = 9
DECODE_STEPS = 7


def _scaled_params(model: Model, params: dict, seed: int = 0) -> dict:
    """Random parameters shaped like `params` with O(1) activations (the default 0.02 init
    gives near-constant logits, which would make any comparison trivially pass)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    new = []
    for (path, leaf), key in zip(leaves, keys):
        names = [getattr(p, "key", str(p)) for p in path]
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        if names[-1] == "scale":
            new.append(1.0 + 0.2 * noise)
        elif names[-1] == "bias":
            new.append(0.1 * noise)
        elif names[-1] == "embedding":
            new.append(noise)
        else:  # kernels (in, out)
            new.append(noise / np.sqrt(leaf.shape[0]))
    params = jax.tree_util.tree_unflatten(treedef, new)
    return tie_lm_head(params) if model.cfg.tie_embeddings else params


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    loaded = registry.load(request.param)
    return loaded.model, _scaled_params(loaded.model, loaded.params)


def _tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture(params=[None, 4, "looped", "tiled"],
                ids=["prefill_block_default", "prefill_block_4", "prefill_blocks_looped",
                     "prefill_tiled"])
def prefill_block(request, monkeypatch):
    """Prefill and forward attention in query blocks of 4 rows (attention.causal_attention):
    several blocks at these lengths, unrolled, as the loop of very long prompts, or as the
    plaintext tiles of 4 queries x 8 keys with an online softmax, checked against decode
    steps, which never use blocks."""
    from mpcache_jax import attention
    if request.param is not None:
        monkeypatch.setattr(attention, "PREFILL_BLOCK", 4)
    if request.param == "looped":
        monkeypatch.setattr(attention, "LOOPED_SCORE_ELEMENTS", 0)
        monkeypatch.setattr(attention, "TILED_MIN_TOKENS", 1 << 62)
    if request.param == "tiled":
        monkeypatch.setattr(attention, "TILED_MIN_TOKENS", 0)
        monkeypatch.setattr(attention, "CPU_TILE", (4, 8))
    jax.clear_caches()   # the block size is read at trace time
    yield request.param
    jax.clear_caches()


# ----- cache consistency ------------------------------------------------------------------
def test_cached_decode_matches_uncached_forward(tiny, prefill_block):
    model, params = tiny
    tokens = _tokens(PROMPT_LEN + DECODE_STEPS, model.cfg.vocab_size)
    ref = np.asarray(model.forward(params, tokens))
    assert np.std(ref) > 0.5, "logits too flat for a meaningful comparison"
    cache = model.init_cache(PROMPT_LEN + DECODE_STEPS)
    logits, cache, _ = model.prefill(params, tokens[:PROMPT_LEN], cache, all_logits=True)
    errs = {"prefill": _max_err(logits, ref[:PROMPT_LEN])}
    for step in range(DECODE_STEPS):
        pos = PROMPT_LEN + step
        logits, cache = model.decode_step(params, tokens[pos], pos, cache)
        errs[f"decode_{step}"] = _max_err(logits, ref[pos])
        # Re-running the whole sequence so far without a cache gives the same logits.
        errs[f"rerun_{step}"] = _max_err(logits, model.forward(params, tokens[:pos + 1])[-1])
    assert int(cache[0].length) == PROMPT_LEN + DECODE_STEPS
    print(f"{model.cfg.name} max |dlogit| cache vs no cache: {max(errs.values()):.2e}")
    assert max(errs.values()) <= TOL, errs


def test_prefill_last_logits_equal_all_logits_row(tiny):
    model, params = tiny
    tokens = _tokens(PROMPT_LEN, model.cfg.vocab_size, seed=3)
    last, _, _ = model.prefill(params, tokens, model.init_cache(PROMPT_LEN))
    full, _, aux = model.prefill(params, tokens, model.init_cache(PROMPT_LEN), all_logits=True,
                                 return_queries=True)
    assert last.shape == (model.cfg.vocab_size,)
    assert _max_err(last, full[-1]) <= TOL
    assert len(aux.queries) == model.cfg.num_layers
    assert aux.queries[0].shape == (model.cfg.num_heads, PROMPT_LEN, model.cfg.head_dim)


# ----- compile reuse ----------------------------------------------------------------------
def test_decode_step_compiles_once(tiny):
    model, params = tiny
    tokens = _tokens(PROMPT_LEN + DECODE_STEPS, model.cfg.vocab_size, seed=1)
    capacity = PROMPT_LEN + DECODE_STEPS + 5  # a capacity no other test uses
    _, cache, _ = model.prefill(params, tokens[:PROMPT_LEN], model.init_cache(capacity))
    before = model_mod._decode._cache_size()
    _, cache = model.decode_step(params, tokens[PROMPT_LEN], PROMPT_LEN, cache, FULL)
    after_first = model_mod._decode._cache_size()
    assert after_first == before + 1
    for step in range(1, DECODE_STEPS):
        pos = PROMPT_LEN + step
        # Python ints, numpy ints and jax scalars all hit the same compiled function.
        token = [int, np.int32, jnp.int32][step % 3](tokens[pos])
        _, cache = model.decode_step(params, token, pos, cache, FULL)
    # A new cache of the same shape (fresh prefill) and an equal policy reuse it too.
    _, cache2, _ = model.prefill(params, tokens[:PROMPT_LEN], model.init_cache(capacity))
    model.decode_step(params, tokens[PROMPT_LEN], PROMPT_LEN, cache2, type(FULL)())
    assert model_mod._decode._cache_size() == after_first


# ----- input validation -------------------------------------------------------------------
def test_prompt_longer_than_cache(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match="longer than the cache capacity 4"):
        model.prefill(params, _tokens(5, model.cfg.vocab_size), model.init_cache(4))


def test_unknown_model_name():
    with pytest.raises(ConfigError, match="unknown model 'gpt5'.*registered models: .*llama-tiny"):
        registry.load("gpt5")


def test_bad_head_counts():
    base = dict(arch="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, intermediate_size=128, max_position=128)
    ModelConfig(**base)
    with pytest.raises(ConfigError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        ModelConfig(**{**base, "num_kv_heads": 3})
    with pytest.raises(ConfigError, match="hidden_size=64 is not divisible by num_heads=6"):
        ModelConfig(**{**base, "num_heads": 6, "num_kv_heads": 6})
    with pytest.raises(ConfigError, match="gpt2 has no grouped-query attention"):
        ModelConfig(**{**base, "arch": "gpt2"})
    with pytest.raises(ConfigError, match="num_layers"):
        registry.get_config("llama-tiny", num_layers=99)


def test_token_ids_out_of_vocab(tiny):
    model, params = tiny
    V = model.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\)"):
        model.forward(params, [1, 2, V])
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\)"):
        model.prefill(params, [-1, 2], model.init_cache(4))
    with pytest.raises(ValueError, match="integer ids"):
        model.forward(params, [1.5, 2.0])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        model.forward(params, [])


def test_decode_token_out_of_vocab(tiny):
    model, params = tiny
    V = model.cfg.vocab_size
    _, cache, _ = model.prefill(params, [1, 2], model.init_cache(4))
    with pytest.raises(ValueError, match="token"):
        model.decode_step(params, V, 2, cache)


def test_decode_past_cache_capacity(tiny):
    model, params = tiny
    _, cache, _ = model.prefill(params, [1, 2], model.init_cache(2))
    with pytest.raises(ValueError, match="capacity"):
        model.decode_step(params, 3, 2, cache)


def test_position_beyond_context(tiny):
    model, params = tiny
    P = model.cfg.max_position
    _, cache, _ = model.prefill(params, [1, 2], model.init_cache(4))
    with pytest.raises(ValueError, match=rf"position {P} is outside the model's context of {P}"):
        model.decode_step(params, 3, P, cache)
    with pytest.raises(ValueError, match="position -1 is outside"):
        model.decode_step(params, 3, -1, cache)
    small = Model(model.cfg.replace(max_position=8))
    with pytest.raises(ValueError, match="9 tokens exceed the model's context of 8 positions"):
        small.forward(params, _tokens(9, model.cfg.vocab_size))


# ----- LLaMA with GQA against transformers -------------------------------------------------
def _llama_params_from_hf(state: dict, cfg: ModelConfig) -> dict:
    """transformers LlamaForCausalLM state dict (Linear weights (out, in)) -> our tree."""
    sd = {k: v.detach().float().numpy() for k, v in state.items()}
    t = lambda name: jnp.asarray(np.ascontiguousarray(sd[name].T))
    params = {"embed": {"embedding": jnp.asarray(sd["model.embed_tokens.weight"])},
              "final_norm": {"scale": jnp.asarray(sd["model.norm.weight"])}}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        params[f"layers_{i}"] = {
            "input_norm": {"scale": jnp.asarray(sd[p + "input_layernorm.weight"])},
            "post_norm": {"scale": jnp.asarray(sd[p + "post_attention_layernorm.weight"])},
            **{f"{n}_proj": {"kernel": t(p + f"self_attn.{n}_proj.weight")} for n in "qkvo"},
            **{f"{n}_proj": {"kernel": t(p + f"mlp.{n}_proj.weight")}
               for n in ("gate", "up", "down")},
        }
    return tie_lm_head(params)


def test_llama_gqa_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=128, vocab_size=256, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[1]))
    hf.eval()
    cfg = ModelConfig(arch="llama", name="llama-gqa-test", vocab_size=256, hidden_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                      max_position=256, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
                      activation="silu")
    assert cfg.group_size == 2
    model = Model(cfg)
    params = _llama_params_from_hf(hf.state_dict(), cfg)
    fresh = model.init_params()
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(params)

    n = PROMPT_LEN + DECODE_STEPS
    tokens = _tokens(n, 256, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
    assert np.std(ref) > 0.5
    errs = {"forward": _max_err(model.forward(params, tokens), ref)}
    logits, cache, _ = model.prefill(params, tokens[:PROMPT_LEN], model.init_cache(n),
                                     all_logits=True)
    errs["prefill"] = _max_err(logits, ref[:PROMPT_LEN])
    for step in range(DECODE_STEPS):
        pos = PROMPT_LEN + step
        logits, cache = model.decode_step(params, tokens[pos], pos, cache)
        errs[f"decode_{step}"] = _max_err(logits, ref[pos])
    print("llama GQA vs transformers max |dlogit|:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL, errs


def test_models_package_has_no_import_cycle():
    """The loaders (smollm2, hf_gpt2) and everything under them never import the registry,
    which imports them: the module import graph of models/ is acyclic."""
    import ast
    import pathlib
    root = pathlib.Path(model_mod.__file__).parent
    graph = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "models":
                deps |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("models."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("models.")}
        graph[path.stem] = deps & {p.stem for p in root.glob("*.py")}
    assert "smollm2" in graph["registry"] and "hf_gpt2" in graph["registry"]

    def reaches(start, target, seen=()):
        return any(d == target or (d not in seen and reaches(d, target, seen + (d,)))
                   for d in graph[start])
    cycles = sorted(m for m in graph if reaches(m, m))
    assert not cycles, f"import cycle through {cycles}: {graph}"
