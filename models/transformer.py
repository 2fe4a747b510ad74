"""Decoder-only transformers (LLaMA family and GPT-2) as pure functions of a parameter pytree.

Parameters and the KV cache are explicit pytrees, passed in and returned. The decoder layers run
as one loop (`lax.scan`) over their parameters stacked on a leading axis when every layer has
the same shape and kind, so a model compiles one layer instead of one copy per layer; a model
with sliding-window layers (Gemma 3), or a cache whose layers differ in shape (per-layer
budgets), runs them one after another.

Parameter tree (both architectures; `init_params`):
  embed/embedding [V, D]            pos_embed/embedding [P, D] (gpt2)
  layers_i/input_norm/{scale[, bias]}  layers_i/post_norm/{scale[, bias]}
  llama: layers_i/{q,k,v,o}_proj/kernel, layers_i/{gate,up,down}_proj/kernel
         (+ layers_i/{q_norm,k_norm}/scale [d] with qk_norm, layers_i/{attn_out_norm,
         mlp_out_norm}/scale with sandwich_norms)
  gpt2:  layers_i/qkv_proj/{kernel,bias}, layers_i/o_proj/{kernel,bias},
         layers_i/fc_in/{kernel,bias}, layers_i/fc_out/{kernel,bias}
  final_norm/{scale[, bias]}        lm_head/kernel [D, V] (a contiguous copy of embed.T when tied)
Kernels are (in_features, out_features). `stack_layers` turns the `layers_i` entries into one
`layers` entry whose leaves have a leading layer axis (what the layer loop reads; the model
functions take either form and stack inside the program when given `layers_i`).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import attention
from mpcache_jax.cache import LayerStack, SplitCache, fill_prefix, fill_window, model_layers, window_append
from mpcache_jax.policy import AttentionPolicy
from models.config import ModelConfig

INIT_STDDEV = 0.02


# RMSNorm under fixed point (SPU, FM64 with 18 fraction bits): x * x overflows the ring once
# |x| > ~2^13.5 and SPU's rsqrt returns ~0 for inputs >= ~2^17. SmolLM2's attention-sink row
# reaches |x| ~ 2.5e4 (mean square ~1.1e6) from layer 12 on, which zeroed its normalised row
# and corrupted every later layer. Rows with a large mean square are therefore normalised from
# x * 2^-NORM_SHIFT (RMSNorm is scale invariant); small rows keep full precision.
NORM_SHIFT = 8
NORM_LARGE_MEAN_SQUARE = 2.0 ** 15


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """x: [..., D] -> 1 / sqrt(mean(x^2) + eps) [..., 1], in a form that stays in range in
    fixed point: the row's magnitude (a secret comparison, no data-dependent control flow)
    selects the mean square of x or of x * 2^-NORM_SHIFT, and one rsqrt of the selected value
    is rescaled. Selecting before the rsqrt (not after two) halves the norm's rsqrt rounds
    under MPC: rsqrt is an iterative protocol, a select is one multiplication."""
    shift = 2.0 ** -NORM_SHIFT
    mean_square = jnp.mean(x * x, axis=-1, keepdims=True)                  # small rows only
    shifted_mean_square = jnp.mean((x * shift) * x, axis=-1, keepdims=True)  # never overflows
    large = shifted_mean_square > shift * NORM_LARGE_MEAN_SQUARE
    scale = jax.lax.rsqrt(jnp.where(large, shifted_mean_square + shift * eps, mean_square + eps))
    return jnp.where(large, scale * shift ** 0.5, scale)


def rms_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; p: {"scale": [D]}."""
    x32 = x.astype(jnp.float32)
    return x32 * rms_scale(x32, eps) * p["scale"]


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis; p: {"scale": [D], "bias": [D]}."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def dense(p: dict, x: jax.Array, min_rows: int = 1) -> jax.Array:
    """x [..., in] @ p["kernel"] [in, out] (+ p["bias"]).

    min_rows: a product of fewer rows is computed on that many (zero rows appended, then
    dropped). XLA:CPU emits a one-row product whose weights are sliced out of the stacked
    layers inside the layer loop as an unvectorised loop (6x slower decode); two rows make it
    a matrix product. Plaintext XLA decoding passes 2; secure programs keep 1 (a padded row
    would be computed under MPC too)."""
    rows = x.reshape(-1, x.shape[-1])
    pad = min_rows - rows.shape[0]
    if pad > 0:
        rows = jnp.concatenate([rows, jnp.zeros((pad, rows.shape[1]), rows.dtype)], axis=0)
    out = jax.lax.dot_general(rows, p["kernel"], (((1,), (0,)), ((), ())))
    if pad > 0:
        out = out[:out.shape[0] - pad]
    if "bias" in p:
        out = out + p["bias"]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _exact_activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


# Piecewise-polynomial activations (PUMA-style): 0 below the first breakpoint, x above the
# last, a Chebyshev least-squares polynomial on each middle segment. Breakpoints and degrees:
# max |error| over the real line 0.005 (GeLU) and 0.010 (SiLU), measured by tests/test_mpc.py.
POLY_SEGMENTS = {
    "silu": ((-8.0, -2.5, 4), (-2.5, 8.0, 8)),
    "gelu": ((-5.0, -2.0, 4), (-2.0, 5.0, 8)),
}


def _fit_segment(fn, lo: float, hi: float, degree: int) -> np.ndarray:
    """Power-basis coefficients in t = (x - mid) / half in [-1, 1] (t keeps every power <= 1,
    which fixed point needs), fitted at 2000 Chebyshev nodes of [lo, hi]."""
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    nodes = np.cos(np.linspace(0.0, np.pi, 2000))
    x = nodes * half + mid
    with jax.ensure_compile_time_eval():  # the fit may first happen while a model is traced
        y = np.asarray(fn(jnp.asarray(x)))
    cheb = np.polynomial.chebyshev.chebfit(nodes, y, degree)
    return np.polynomial.chebyshev.cheb2poly(cheb).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _poly_pieces(base: str) -> tuple:
    exact = _exact_activation(base)
    return tuple((lo, hi, _fit_segment(exact, lo, hi, deg)) for lo, hi, deg in POLY_SEGMENTS[base])


def poly_activation(name: str):
    """Piecewise-polynomial stand-in for `name` (gelu_tanh uses the GeLU fit)."""
    pieces = _poly_pieces("silu" if name == "silu" else "gelu")

    def fn(x):
        # at_or_above[i] = x >= breakpoint i; segment i is at_or_above[i] - at_or_above[i + 1].
        bounds = [lo for lo, _, _ in pieces] + [pieces[-1][1]]
        above = [(x >= b).astype(x.dtype) for b in bounds]
        y = above[-1] * x
        for i, (lo, hi, coef) in enumerate(pieces):
            t = (x - (lo + hi) / 2) / ((hi - lo) / 2)
            p = jnp.full_like(x, coef[-1])
            for c in coef[-2::-1]:
                p = p * t + c
            y = y + (above[i] - above[i + 1]) * p
        return y
    return fn


def newton_sigmoid(x: jax.Array, steps: int = 3) -> jax.Array:
    """sigmoid(x) with one comparison, one exp and `steps` Newton steps (no general reciprocal).

    With z = exp(-|x|) in (0, 1], sigmoid(|x|) = 1 / (1 + z) has its denominator in (1, 2],
    where Newton's y <- y (2 - d y) from the linear guess 1.4571 - d / 2 (relative error
    <= 0.086) squares the error each step: 3 steps reach float32 precision. The sign folds
    back as sigmoid(x) = 1 - sigmoid(|x|) for x < 0. Under MPC this replaces the
    range-normalising reciprocal of 1 / (1 + exp(-x)) (37% less ABY3 communication for SiLU).
    """
    negative = (x < 0).astype(jnp.int32)
    z = jnp.exp(-(x * (1 - 2 * negative)))
    d = 1.0 + z
    y = 1.4571 - 0.5 * d
    for _ in range(steps):
        y = y * (2.0 - d * y)
    return y + negative * (1.0 - 2.0 * y)


def newton_activation(name: str):
    """SiLU = x sigmoid(x); tanh-GeLU = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))."""
    if name == "silu":
        return lambda x: x * newton_sigmoid(x)
    if name == "gelu_tanh":
        c = 2.0 * math.sqrt(2.0 / math.pi)
        return lambda x: x * newton_sigmoid(c * (x + 0.044715 * x * x * x))
    raise ValueError(f"activation_impl='newton' covers silu and gelu_tanh, not {name!r}; use "
                     "'exact' or 'poly' for the erf GeLU")


def activation_fn(name: str, impl: str = "exact"):
    if impl == "poly":
        return poly_activation(name)
    if impl == "newton":
        return newton_activation(name)
    return _exact_activation(name)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [T, head_dim] for the half-rotation ("rotate_half") RoPE convention."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [heads, T, d]; cos, sin: [T, d]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None] + rotated * sin[None]


# ----- blocks -----------------------------------------------------------------------------------
def _norm(cfg: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    return layer_norm(p, x, cfg.norm_eps) if cfg.arch == "gpt2" else rms_norm(p, x, cfg.norm_eps)


def block_qkv(cfg: ModelConfig, p: dict, x: jax.Array, positions: jax.Array, local,
              min_rows: int = 1):
    """One layer's attention inputs. x: [T, D] -> q [H, T, d], k [H_kv, T, d], v [H_kv, T, d]
    (RoPE applied; GPT-2 adds learned positions to the embeddings instead).

    LLaMA and, through the config's switches, Gemma 3: `local` (a sliding-window layer: its
    RoPE base is rope_local_theta; a bool, or a traced one inside the layer loop), qk_norm
    (q_norm/k_norm over head_dim before RoPE) and query_pre_attn_scalar."""
    c = cfg
    T = x.shape[0]
    if c.arch == "gpt2":
        fused = dense(p["qkv_proj"], layer_norm(p["input_norm"], x, c.norm_eps), min_rows)
        fused = fused.reshape(T, 3, c.num_heads, c.head_dim)
        q, k, v = (fused[:, i].transpose(1, 0, 2) for i in range(3))
        return q, k, v
    h = rms_norm(p["input_norm"], x, c.norm_eps)
    q = dense(p["q_proj"], h, min_rows).reshape(T, c.num_heads, c.head_dim)
    k = dense(p["k_proj"], h, min_rows).reshape(T, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = rms_norm(p["q_norm"], q, c.norm_eps), rms_norm(p["k_norm"], k, c.norm_eps)
    q, k = q.transpose(1, 0, 2), k.transpose(1, 0, 2)
    v = dense(p["v_proj"], h, min_rows).reshape(T, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
    cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
    if c.rope_local_theta:
        cos_l, sin_l = rope_tables(positions, c.head_dim, c.rope_local_theta)
        if isinstance(local, (bool, np.bool_)):
            cos, sin = (cos_l, sin_l) if local else (cos, sin)
        else:
            cos, sin = jnp.where(local, cos_l, cos), jnp.where(local, sin_l, sin)
    q = apply_rope(q, cos, sin)
    if c.query_pre_attn_scalar is not None and c.query_pre_attn_scalar != c.head_dim:
        # The attention kernels scale q . k by 1 / sqrt(head_dim); the model wants
        # 1 / sqrt(query_pre_attn_scalar).
        q = q * math.sqrt(c.head_dim / c.query_pre_attn_scalar)
    return q, apply_rope(k, cos, sin), v


def block_finish(cfg: ModelConfig, p: dict, x: jax.Array, attn: jax.Array,
                 min_rows: int = 1) -> jax.Array:
    """x: [T, D] residual stream; attn: [H, T, d] attention output -> block output [T, D].
    LLaMA: o_proj, (attn_out_norm), residual, post_norm, gated MLP, (mlp_out_norm), residual;
    GPT-2: o_proj, residual, post_norm, MLP, residual."""
    c = cfg
    T = x.shape[0]
    out = dense(p["o_proj"], attn.transpose(1, 0, 2).reshape(T, -1), min_rows)
    act = activation_fn(c.activation, c.activation_impl)
    if c.arch == "gpt2":
        x = x + out
        h = layer_norm(p["post_norm"], x, c.norm_eps)
        return x + dense(p["fc_out"], act(dense(p["fc_in"], h, min_rows)), min_rows)
    x = x + (rms_norm(p["attn_out_norm"], out, c.norm_eps) if c.sandwich_norms else out)
    h = rms_norm(p["post_norm"], x, c.norm_eps)
    out = dense(p["down_proj"], act(dense(p["gate_proj"], h, min_rows)) *
                dense(p["up_proj"], h, min_rows), min_rows)
    return x + (rms_norm(p["mlp_out_norm"], out, c.norm_eps) if c.sandwich_norms else out)


# ----- parameters ---------------------------------------------------------------------------------
def _layer_shapes(cfg: ModelConfig) -> dict:
    c, D = cfg, cfg.hidden_size
    if c.arch == "gpt2":
        norm = lambda: {"scale": (D,), "bias": (D,)}
        lin = lambda i, o: {"kernel": (i, o), "bias": (o,)}
        return {"input_norm": norm(), "post_norm": norm(), "qkv_proj": lin(D, 3 * D),
                "o_proj": lin(D, D), "fc_in": lin(D, c.intermediate_size),
                "fc_out": lin(c.intermediate_size, D)}
    lin = lambda i, o: {"kernel": (i, o)}
    out = {"input_norm": {"scale": (D,)}, "post_norm": {"scale": (D,)},
           "q_proj": lin(D, c.num_heads * c.head_dim), "k_proj": lin(D, c.num_kv_heads * c.head_dim),
           "v_proj": lin(D, c.num_kv_heads * c.head_dim), "o_proj": lin(c.num_heads * c.head_dim, D),
           "gate_proj": lin(D, c.intermediate_size), "up_proj": lin(D, c.intermediate_size),
           "down_proj": lin(c.intermediate_size, D)}
    if c.qk_norm:
        out["q_norm"] = {"scale": (c.head_dim,)}
        out["k_norm"] = {"scale": (c.head_dim,)}
    if c.sandwich_norms:
        out["attn_out_norm"] = {"scale": (D,)}
        out["mlp_out_norm"] = {"scale": (D,)}
    return out


def param_shapes(cfg: ModelConfig) -> dict:
    """{path: shape} tree of the parameters (`layers_i` form; lm_head untied and tied alike)."""
    D = cfg.hidden_size
    shapes = {"embed": {"embedding": (cfg.vocab_size, D)}}
    if cfg.arch == "gpt2":
        shapes["pos_embed"] = {"embedding": (cfg.max_position, D)}
    for i in range(cfg.num_layers):
        shapes[f"layers_{i}"] = _layer_shapes(cfg)
    shapes["final_norm"] = {"scale": (D,), "bias": (D,)} if cfg.arch == "gpt2" else {"scale": (D,)}
    shapes["lm_head"] = {"kernel": (D, cfg.vocab_size)}
    return shapes


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random parameters: normal(0.02) kernels and embeddings, unit norm scales, zero biases
    (`layers_i` form; a tied model's lm_head is filled in by `models.model.tie_lm_head`)."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = []
    for (path, shape), key in zip(leaves, keys):
        name = path[-1].key
        if name == "scale":
            out.append(jnp.ones(shape, jnp.float32))
        elif name == "bias":
            out.append(jnp.zeros(shape, jnp.float32))
        else:
            out.append(INIT_STDDEV * jax.random.normal(key, shape, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, out)


def stack_layers(params: dict) -> dict:
    """`layers_i` entries -> one `layers` entry with the layers on a leading axis (works on
    arrays, on traced values and on ShapeDtypeStructs); a stacked tree is returned as it is."""
    if "layers" in params:
        return params
    count = sum(1 for name in params if name.startswith("layers_"))
    per_layer = [params[f"layers_{i}"] for i in range(count)]
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(per_layer[0])):
        stacked = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((count,) + tuple(x.shape), x.dtype), per_layer[0])
    elif all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(per_layer)):
        stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *per_layer)
    else:
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per_layer)
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = stacked
    return out


def unstack_layers(params: dict) -> dict:
    """The inverse of `stack_layers`: one `layers_i` entry per layer."""
    if "layers" not in params:
        return params
    count = jax.tree_util.tree_leaves(params["layers"])[0].shape[0]
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(count):
        out[f"layers_{i}"] = jax.tree_util.tree_map(lambda x: x[i], params["layers"])
    return out


def layer_params(params: dict, index: int) -> dict:
    """One layer's parameters from either form."""
    if "layers" in params:
        return jax.tree_util.tree_map(lambda x: x[index], params["layers"])
    return params[f"layers_{index}"]


# ----- the model -------------------------------------------------------------------------------------
def scans_layers(cfg: ModelConfig) -> bool:
    """Whether the model's layers run as one loop: every layer of one kind (no sliding-window
    layers beside global ones)."""
    return not cfg.has_local_layers


def embed(cfg: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens: int ids [T], or one-hot rows [T, V] (float; MPC: a secret token becomes a
    one-hot matmul instead of a secret-index gather) -> [T, D]."""
    table = params["embed"]["embedding"]
    if jnp.issubdtype(tokens.dtype, jnp.floating):
        x = tokens @ table.astype(tokens.dtype)
    else:
        x = jnp.take(table, tokens, axis=0).astype(jnp.float32)
    if cfg.arch == "gpt2":
        x = x + jnp.take(params["pos_embed"]["embedding"], positions, axis=0)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    return x


def lm_logits(cfg: ModelConfig, params: dict, x: jax.Array) -> jax.Array:
    """Final norm + LM head of a residual stream [T, D] -> logits [T, V]."""
    return dense(params["lm_head"], _norm(cfg, params["final_norm"], x))


def _prompt_attention(cfg: ModelConfig, index: int | None, q, k, v):
    """Causal attention of a layer over a whole sequence (its window if local)."""
    window = None if index is None else cfg.window_of(index)
    return attention.causal_attention(q, k, v, attention.PREFILL_BLOCK, window=window)


def residual_stream(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Every decoder layer over the whole sequence, no cache -> residual stream [T, D]."""
    positions = jnp.arange(tokens.shape[0])
    x = embed(cfg, params, tokens, positions)
    if scans_layers(cfg):
        def body(x, p):
            q, k, v = block_qkv(cfg, p, x, positions, False)
            return block_finish(cfg, p, x, _prompt_attention(cfg, None, q, k, v)), None
        return jax.lax.scan(body, x, stack_layers(params)["layers"])[0]
    for index in range(cfg.num_layers):
        p = layer_params(params, index)
        q, k, v = block_qkv(cfg, p, x, positions, cfg.local_layers[index])
        x = block_finish(cfg, p, x, _prompt_attention(cfg, index, q, k, v))
    return x


def forward(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Whole-sequence forward without a cache. tokens: [T] (or one-hot [T, V]) -> logits [T, V]."""
    return lm_logits(cfg, params, residual_stream(cfg, params, tokens))


def forward_hidden(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Whole-sequence forward through the decoder layers without a cache -> residual stream
    of the last position [1, D] (the no-KV-cache decode step of cost runs)."""
    return residual_stream(cfg, params, tokens)[-1:]


def _pack(cfg: ModelConfig, states):
    """Per-layer states (model order) -> the cache pytree: a tuple, or a SplitCache when the
    model has local layers."""
    if cfg.has_local_layers:
        return SplitCache.from_layers(states, cfg.local_layers)
    return tuple(states)


def prefill(cfg: ModelConfig, params: dict, tokens, cache, return_queries: bool,
            all_logits: bool, length=None):
    """tokens: [T] (or one-hot [T, V]); cache: an empty cache of capacity >= T (`init_cache`):
    a LayerStack or tuple of LayerKV, or a SplitCache (global layers' LayerKV, local layers'
    WindowKV). length: int32 [] number of real tokens when `tokens` is a prompt padded at the
    end to a bucket of T (causal attention: the padding never reaches them); default T.

    Returns (logits [T, V] or [V] (of token length - 1), filled cache of the same form,
    queries of the global (evicting) layers ([L, H, T, d] stacked, or a tuple of [H, T, d])
    or None)."""
    positions = jnp.arange(tokens.shape[0])
    x = embed(cfg, params, tokens, positions)
    if scans_layers(cfg):
        stacked = cache.stacked if isinstance(cache, LayerStack) else LayerStack.of(cache).stacked

        def body(x, inputs):
            p, layer = inputs
            q, k, v = block_qkv(cfg, p, x, positions, False)
            x = block_finish(cfg, p, x, _prompt_attention(cfg, None, q, k, v))
            return x, (fill_prefix(layer, k, v, length), q if return_queries else None)
        x, (filled, queries) = jax.lax.scan(body, x, (stack_layers(params)["layers"], stacked))
        new_cache = LayerStack(filled)
        if not isinstance(cache, LayerStack):
            new_cache = tuple(new_cache)
    else:
        states, queries = [], []
        for index, layer in enumerate(model_layers(cache)):
            p = layer_params(params, index)
            local = cfg.local_layers[index]
            q, k, v = block_qkv(cfg, p, x, positions, local)
            x = block_finish(cfg, p, x, _prompt_attention(cfg, index, q, k, v))
            if local:
                states.append(fill_window(layer, k, v, length))
            else:
                states.append(fill_prefix(layer, k, v, length))
                queries.append(q)
        new_cache, queries = _pack(cfg, states), tuple(queries)
    last = x[-1:] if length is None else jax.lax.dynamic_slice_in_dim(x, length - 1, 1)
    logits = lm_logits(cfg, params, x if all_logits else last)
    return (logits if all_logits else logits[0]), new_cache, (queries if return_queries else None)


def decode_hidden(cfg: ModelConfig, params: dict, token, pos, cache, policy: AttentionPolicy,
                  min_rows: int = 1):
    """One decode step through the decoder layers, without the final norm and LM head:
    (residual stream [1, D], cache). token: int32 [] (or one-hot [V]); pos: int32 [] absolute
    position (public under MPC: RoPE tables and cache slots derive from it).

    The policy attends in the global layers (its layer index counts those only); a local layer
    appends to its ring buffer and attends over its window itself. A LayerStack cache runs as
    one loop over the layers (the policy sees a traced layer index); a tuple or SplitCache
    layer after layer."""
    positions = jnp.reshape(pos, (1,))
    x = embed(cfg, params, jnp.reshape(token, (1,) + token.shape), positions)
    carry = policy.init_carry()
    if isinstance(cache, LayerStack) and scans_layers(cfg) and _carry_is_stable(
            cfg, policy, params, x, positions, cache, carry):
        def body(inputs, index_and_params):
            x, stacked, carry = inputs
            index, p = index_and_params
            state = jax.tree_util.tree_map(
                lambda s: jax.lax.dynamic_index_in_dim(s, index, keepdims=False), stacked)
            x, state, carry = _decode_layer(cfg, p, x, positions, state, policy, index, carry,
                                            min_rows)
            stacked = jax.tree_util.tree_map(
                lambda s, new: jax.lax.dynamic_update_index_in_dim(s, new, index, 0),
                stacked, state)
            return (x, stacked, carry), None
        layers = stack_layers(params)["layers"]
        indices = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, stacked, _), _ = jax.lax.scan(body, (x, cache.stacked, carry), (indices, layers))
        return x, LayerStack(stacked)
    new_cache, evicting = [], 0
    states = list(cache) if isinstance(cache, LayerStack) else model_layers(cache)
    for index, state in enumerate(states):
        p = layer_params(params, index)
        if cfg.local_layers[index]:
            q, k, v = block_qkv(cfg, p, x, positions, True, min_rows)
            state = window_append(state, k[:, 0], v[:, 0])
            out = attention.decode_attention(q[:, 0], state.k, state.v, state.valid(),
                                             policy.softmax)
            x = block_finish(cfg, p, x, out[:, None, :], min_rows)
        else:
            x, state, carry = _decode_layer(cfg, p, x, positions, state, policy, evicting,
                                            carry, min_rows)
            evicting += 1
        new_cache.append(state)
    if isinstance(cache, LayerStack):
        return x, LayerStack.of(new_cache)
    return x, _pack(cfg, new_cache)


def _decode_layer(cfg, p, x, positions, state, policy, index, carry, min_rows):
    q, k, v = block_qkv(cfg, p, x, positions, False, min_rows)
    out, state, carry = policy.attend(index, q[:, 0], k[:, 0], v[:, 0], state, carry)
    return block_finish(cfg, p, x, out[:, None, :], min_rows), state, carry


def _carry_is_stable(cfg, policy, params, x, positions, cache, carry) -> bool:
    """Whether the policy's cross-layer carry keeps its structure through a layer (a loop
    needs that; a policy that starts sharing a selection after its first layer runs its
    layers one after another)."""
    def one(x, state):
        p = layer_params(params, 0)
        return _decode_layer(cfg, p, x, positions, state, policy, 0, carry, 1)[2]
    out = jax.eval_shape(one, x, cache[0])
    same = jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(carry)
    return same and all(a.shape == b.shape for a, b in zip(
        jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(carry)))


def decode(cfg: ModelConfig, params: dict, token, pos, cache, policy: AttentionPolicy,
           min_rows: int = 1):
    """One decode step -> (logits [V], cache)."""
    x, new_cache = decode_hidden(cfg, params, token, pos, cache, policy, min_rows)
    return lm_logits(cfg, params, x)[0], new_cache


def param_count(params) -> int:
    return int(sum(math.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))
