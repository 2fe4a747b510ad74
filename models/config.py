"""Model configurations: frozen, validated dataclasses shared by every architecture."""
from __future__ import annotations

import dataclasses

ARCHS = ("llama", "gpt2")
# Attention span of a layer: "global" attends to every earlier token (the cache eviction
# policies act on these layers), "local" to the last `sliding_window` tokens only (its cache is
# a ring buffer of the window, `mpcache_jax.cache.WindowKV`).
LAYER_TYPES = ("global", "local")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
# How MLP activations are evaluated: "exact" (jax.nn, today's behaviour), "poly" (piecewise
# polynomials, PUMA-style: comparisons + multiplications only) or "newton" (sigmoid from
# exp(-|x|) and Newton steps: SiLU and tanh-GeLU, the cheapest of the three under MPC).
ACTIVATION_IMPLS = ("exact", "poly", "newton")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry and numerics of a decoder-only transformer.

    `arch="llama"`: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no biases.
    `arch="gpt2"`: LayerNorm, learned positions, fused QKV with biases, GeLU MLP.

    Switches of the llama block for other families (Gemma 3: see docs/models.md), all off by
    default: `layer_types` ("global"/"local" per layer; None = every layer global) with
    `sliding_window` (tokens a local layer attends to, itself included) and `rope_local_theta`
    (RoPE base of the local layers); `qk_norm` (RMSNorm over head_dim of every query and key
    head before RoPE); `sandwich_norms` (RMSNorm on the attention output and on the MLP output
    before each residual add); `scale_embeddings` (token embeddings times sqrt(hidden_size));
    `query_pre_attn_scalar` (attention logits scaled by its inverse square root instead of
    head_dim's).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position: int
    head_dim: int | None = None  # defaults to hidden_size // num_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    activation: str = "silu"
    name: str = "custom"
    # MPC-friendly numerics (defaults keep exact plaintext behaviour). The attention softmax is
    # always max-subtracted with a bounded mask logit (mpcache_jax/attention.py) and norms
    # always use rsqrt, both MPC-friendly at no plaintext cost.
    activation_impl: str = "exact"
    # Llama-block switches for other families (see the class docstring).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    qk_norm: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ConfigError(f"arch={self.arch!r} is unknown; use one of {ARCHS}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "intermediate_size", "max_position"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{field}={value!r} must be a positive integer")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                    "change one of them or set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs every KV head to serve the same number of query heads")
        if self.arch == "gpt2":
            if self.num_kv_heads != self.num_heads:
                raise ConfigError("gpt2 has no grouped-query attention: set num_kv_heads = num_heads")
            if self.num_heads * self.head_dim != self.hidden_size:
                raise ConfigError(
                    f"gpt2 needs hidden_size = num_heads * head_dim, got {self.hidden_size} != "
                    f"{self.num_heads} * {self.head_dim}")
        if self.arch == "llama" and self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation={self.activation!r} is unknown; use one of {ACTIVATIONS}")
        if self.activation_impl not in ACTIVATION_IMPLS:
            raise ConfigError(f"activation_impl={self.activation_impl!r} is unknown; use one of "
                              f"{ACTIVATION_IMPLS}")
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps={self.norm_eps} must be positive")
        self._check_llama_switches()

    def _check_llama_switches(self):
        switched = [name for name in ("qk_norm", "sandwich_norms", "scale_embeddings")
                    if getattr(self, name)]
        switched += [name for name in ("layer_types", "sliding_window", "rope_local_theta",
                                       "query_pre_attn_scalar") if getattr(self, name) is not None]
        if self.arch != "llama" and switched:
            raise ConfigError(f"{', '.join(switched)} apply to arch='llama' only (got "
                              f"arch={self.arch!r}); leave them at their defaults")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ConfigError(f"query_pre_attn_scalar={self.query_pre_attn_scalar} must be "
                              "positive (or None for head_dim)")
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ConfigError(f"rope_local_theta={self.rope_local_theta} must be positive")
        if self.layer_types is None:
            if self.sliding_window is not None or self.rope_local_theta is not None:
                raise ConfigError("sliding_window and rope_local_theta describe local layers: set "
                                  "layer_types (one 'global' or 'local' per layer) too, or drop them")
            return
        if not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for num_layers="
                              f"{self.num_layers}: give one 'global' or 'local' per layer")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"layer_types holds {unknown}; use {LAYER_TYPES} per layer")
        if "global" not in self.layer_types:
            raise ConfigError("layer_types has no 'global' layer: eviction policies act on the "
                              "global layers, so keep at least one (for a truncated model: keep "
                              "more layers)")
        if "local" in self.layer_types:
            window = self.sliding_window
            if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
                raise ConfigError(f"sliding_window={window!r} must be a positive integer: the "
                                  "tokens a local layer attends to (itself included)")
        elif self.sliding_window is not None:
            raise ConfigError("sliding_window is set but no layer is 'local'; drop it")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer, True for a sliding-window (local) layer."""
        if self.layer_types is None:
            return (False,) * self.num_layers
        return tuple(kind == "local" for kind in self.layer_types)

    @property
    def has_local_layers(self) -> bool:
        return any(self.local_layers)

    def window_of(self, layer: int) -> int | None:
        """Tokens layer `layer` attends to (sliding_window for a local layer, None: all)."""
        return self.sliding_window if self.local_layers[layer] else None

    def rope_theta_of(self, layer: int) -> float:
        if self.local_layers[layer] and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def truncated(self, num_layers: int) -> "ModelConfig":
        """The first `num_layers` layers (their layer types with them)."""
        types = None if self.layer_types is None else self.layer_types[:num_layers]
        if types is not None and "global" not in types:
            first = self.layer_types.index("global")
            raise ConfigError(f"the first {num_layers} layers of {self.name} are all local "
                              f"(sliding-window) layers; eviction policies need a global one: "
                              f"keep at least {first + 1} layers")
        window = self.sliding_window if types is not None and "local" in types else None
        return self.replace(num_layers=num_layers, layer_types=types, sliding_window=window)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
