"""Decoder-only transformers (LLaMA family and GPT-2) as Flax linen modules.

The modules are stateless: parameters are an explicit pytree and the KV cache is passed in
and returned. Layers are separate submodules (`layers_0`, `layers_1`, ...) rather than one
stacked, scanned block: on XLA:CPU slicing stacked weights inside jit copies them (4-5x
slower decode).

Parameter tree (both architectures):
  embed/embedding [V, D]            pos_embed/embedding [P, D] (gpt2)
  layers_i/input_norm/{scale[, bias]}  layers_i/post_norm/{scale[, bias]}
  llama: layers_i/{q,k,v,o}_proj/kernel, layers_i/{gate,up,down}_proj/kernel
         (+ layers_i/{q_norm,k_norm}/scale [d] with qk_norm, layers_i/{attn_out_norm,
         mlp_out_norm}/scale with sandwich_norms)
  gpt2:  layers_i/qkv_proj/{kernel,bias}, layers_i/o_proj/{kernel,bias},
         layers_i/fc_in/{kernel,bias}, layers_i/fc_out/{kernel,bias}
  final_norm/{scale[, bias]}        lm_head/kernel [D, V] (a contiguous copy of embed.T when tied)
Kernels are (in_features, out_features).
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import attention
from mpcache_jax.cache import SplitCache, fill_prefix, fill_window, model_layers, window_append
from mpcache_jax.policy import AttentionPolicy
from models.config import ModelConfig

_INIT = nn.initializers.normal(stddev=0.02)


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


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        return x32 * rms_scale(x32, self.eps) * scale


class LayerNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        mean = jnp.mean(x, axis=-1, keepdims=True)
        centered = x - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        return centered * jax.lax.rsqrt(var + self.eps) * scale + bias


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


class LlamaBlock(nn.Module):
    """LLaMA block and, through the config's switches, Gemma 3's: `local` (a sliding-window
    layer: its RoPE base is rope_local_theta), qk_norm (q_norm/k_norm over head_dim before
    RoPE), sandwich_norms (attn_out_norm / mlp_out_norm on the attention and MLP outputs
    before the residual adds; post_norm stays the pre-MLP norm) and query_pre_attn_scalar."""

    cfg: ModelConfig
    local: bool = False

    def setup(self):
        c = self.cfg
        dense = lambda n, name: nn.Dense(n, use_bias=False, kernel_init=_INIT, name=name)
        self.input_norm = RMSNorm(c.norm_eps)
        self.post_norm = RMSNorm(c.norm_eps)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.norm_eps)
            self.k_norm = RMSNorm(c.norm_eps)
        if c.sandwich_norms:
            self.attn_out_norm = RMSNorm(c.norm_eps)
            self.mlp_out_norm = RMSNorm(c.norm_eps)
        self.q_proj = dense(c.num_heads * c.head_dim, "q_proj")
        self.k_proj = dense(c.num_kv_heads * c.head_dim, "k_proj")
        self.v_proj = dense(c.num_kv_heads * c.head_dim, "v_proj")
        self.o_proj = dense(c.hidden_size, "o_proj")
        self.gate_proj = dense(c.intermediate_size, "gate_proj")
        self.up_proj = dense(c.intermediate_size, "up_proj")
        self.down_proj = dense(c.hidden_size, "down_proj")

    def qkv(self, x, positions):
        """x: [T, D] -> q [H, T, d], k [H_kv, T, d], v [H_kv, T, d] (RoPE applied)."""
        c = self.cfg
        h = self.input_norm(x)
        T = x.shape[0]
        q = self.q_proj(h).reshape(T, c.num_heads, c.head_dim)
        k = self.k_proj(h).reshape(T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 0, 2), k.transpose(1, 0, 2)
        v = self.v_proj(h).reshape(T, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
        theta = c.rope_local_theta if self.local and c.rope_local_theta else c.rope_theta
        cos, sin = rope_tables(positions, c.head_dim, theta)
        q = apply_rope(q, cos, sin)
        if c.query_pre_attn_scalar is not None and c.query_pre_attn_scalar != c.head_dim:
            # The attention kernels scale q . k by 1 / sqrt(head_dim); the model wants
            # 1 / sqrt(query_pre_attn_scalar).
            q = q * math.sqrt(c.head_dim / c.query_pre_attn_scalar)
        return q, apply_rope(k, cos, sin), v

    def finish(self, x, attn):
        """x: [T, D] residual stream; attn: [H, T, d] attention output -> block output [T, D]."""
        T = x.shape[0]
        out = self.o_proj(attn.transpose(1, 0, 2).reshape(T, -1))
        x = x + (self.attn_out_norm(out) if self.cfg.sandwich_norms else out)
        h = self.post_norm(x)
        act = activation_fn(self.cfg.activation, self.cfg.activation_impl)
        out = self.down_proj(act(self.gate_proj(h)) * self.up_proj(h))
        return x + (self.mlp_out_norm(out) if self.cfg.sandwich_norms else out)


class GPT2Block(nn.Module):
    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        dense = lambda n, name: nn.Dense(n, use_bias=True, kernel_init=_INIT, name=name)
        self.input_norm = LayerNorm(c.norm_eps)
        self.post_norm = LayerNorm(c.norm_eps)
        self.qkv_proj = dense(3 * c.hidden_size, "qkv_proj")
        self.o_proj = dense(c.hidden_size, "o_proj")
        self.fc_in = dense(c.intermediate_size, "fc_in")
        self.fc_out = dense(c.hidden_size, "fc_out")

    def qkv(self, x, positions):
        del positions  # GPT-2 adds learned position embeddings to the input instead
        c = self.cfg
        T = x.shape[0]
        fused = self.qkv_proj(self.input_norm(x)).reshape(T, 3, c.num_heads, c.head_dim)
        q, k, v = (fused[:, i].transpose(1, 0, 2) for i in range(3))
        return q, k, v

    def finish(self, x, attn):
        T = x.shape[0]
        x = x + self.o_proj(attn.transpose(1, 0, 2).reshape(T, -1))
        act = activation_fn(self.cfg.activation, self.cfg.activation_impl)
        return x + self.fc_out(act(self.fc_in(self.post_norm(x))))


class DecoderLM(nn.Module):
    """Token embedding -> blocks -> final norm -> LM head, with prefill and decode entry points."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        self.embed = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=_INIT)
        if c.arch == "gpt2":
            self.pos_embed = nn.Embed(c.max_position, c.hidden_size, embedding_init=_INIT)
            self.final_norm = LayerNorm(c.norm_eps)
            block = GPT2Block
        else:
            self.final_norm = RMSNorm(c.norm_eps)
            block = LlamaBlock
        if c.has_local_layers:
            self.layers = [block(c, local) for local in c.local_layers]
        else:
            self.layers = [block(c) for _ in range(c.num_layers)]
        self.lm_head = nn.Dense(c.vocab_size, use_bias=False, kernel_init=_INIT)

    def _embed(self, tokens, positions):
        """tokens: int ids [T], or one-hot rows [T, V] (float; MPC: a secret token becomes a
        one-hot matmul instead of a secret-index gather)."""
        if jnp.issubdtype(tokens.dtype, jnp.floating):
            x = tokens @ self.embed.embedding.astype(tokens.dtype)
        else:
            x = self.embed(tokens).astype(jnp.float32)
        if self.cfg.arch == "gpt2":
            x = x + self.pos_embed(positions)
        if self.cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), x.dtype)
        return x

    def _prompt_attention(self, index, q, k, v):
        """Causal attention of layer `index` over a whole sequence (its window if local)."""
        return attention.causal_attention(q, k, v, attention.PREFILL_BLOCK,
                                          window=self.cfg.window_of(index))

    def _residual_stream(self, tokens):
        """Every decoder layer over the whole sequence, no cache -> residual stream [T, D]."""
        positions = jnp.arange(tokens.shape[0])
        x = self._embed(tokens, positions)
        for index, block in enumerate(self.layers):
            q, k, v = block.qkv(x, positions)
            x = block.finish(x, self._prompt_attention(index, q, k, v))
        return x

    def __call__(self, tokens):
        """Whole-sequence forward without a cache. tokens: [T] (or one-hot [T, V]) -> logits [T, V]."""
        return self.lm_head(self.final_norm(self._residual_stream(tokens)))

    def forward_hidden(self, tokens):
        """Whole-sequence forward through the decoder layers without a cache -> residual stream
        of the last position [1, D] (the no-KV-cache decode step of cost runs)."""
        return self._residual_stream(tokens)[-1:]

    def _pack(self, states):
        """Per-layer states (model order) -> the cache pytree: a tuple, or a SplitCache when
        the model has local layers."""
        if self.cfg.has_local_layers:
            return SplitCache.from_layers(states, self.cfg.local_layers)
        return tuple(states)

    def prefill(self, tokens, cache, return_queries: bool, all_logits: bool, length=None):
        """tokens: [T] (or one-hot [T, V]); cache: model.init_cache of capacity >= T (empty):
        per-layer LayerKV, or a SplitCache (global layers' LayerKV, local layers' WindowKV).
        length: int32 [] number of real tokens when `tokens` is a prompt padded at the end to a
        bucket of T (causal attention: the padding never reaches them); default T.

        Returns (logits [T, V] or [V] (of token length - 1), filled cache, queries [H, T, d]
        of the global (evicting) layers or None).
        """
        positions = jnp.arange(tokens.shape[0])
        x = self._embed(tokens, positions)
        new_cache, queries = [], []
        for index, (block, layer) in enumerate(zip(self.layers, model_layers(cache))):
            q, k, v = block.qkv(x, positions)
            x = block.finish(x, self._prompt_attention(index, q, k, v))
            if self.cfg.local_layers[index]:
                new_cache.append(fill_window(layer, k, v, length))
            else:
                new_cache.append(fill_prefix(layer, k, v, length))
                queries.append(q)
        last = x[-1:] if length is None else jax.lax.dynamic_slice_in_dim(x, length - 1, 1)
        h = self.final_norm(x if all_logits else last)
        logits = self.lm_head(h)
        return (logits if all_logits else logits[0]), self._pack(new_cache), (
            tuple(queries) if return_queries else None)

    def decode(self, token, pos, cache, policy: AttentionPolicy):
        """token: int32 [] (or one-hot [V]); pos: int32 [] absolute position (public under MPC:
        RoPE tables and cache slots derive from it). Returns (logits [V], cache)."""
        x, new_cache = self.decode_hidden(token, pos, cache, policy)
        return self.lm_head(self.final_norm(x))[0], new_cache

    def decode_hidden(self, token, pos, cache, policy: AttentionPolicy):
        """`decode` without the final norm and LM head: (residual stream [1, D], cache).
        Cost runs measure the decoder layers apart from the policy-independent LM head.

        The policy attends in the global layers (its layer index counts those only); a local
        layer appends to its ring buffer and attends over its window itself."""
        positions = jnp.reshape(pos, (1,))
        x = self._embed(jnp.reshape(token, (1,) + token.shape), positions)
        carry = policy.init_carry()
        new_cache = []
        evicting = 0
        for index, (block, state) in enumerate(zip(self.layers, model_layers(cache))):
            q, k, v = block.qkv(x, positions)
            if self.cfg.local_layers[index]:
                state = window_append(state, k[:, 0], v[:, 0])
                out = attention.decode_attention(q[:, 0], state.k, state.v, state.valid(),
                                                 policy.softmax)
            else:
                out, state, carry = policy.attend(evicting, q[:, 0], k[:, 0], v[:, 0], state,
                                                  carry)
                evicting += 1
            x = block.finish(x, out[:, None, :])
            new_cache.append(state)
        return x, self._pack(new_cache)

    def lm_logits(self, x):
        """Final norm + LM head of a residual stream [T, D] -> logits [T, V]."""
        return self.lm_head(self.final_norm(x))


def param_count(params) -> int:
    return int(sum(math.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))
