"""Model configurations: frozen, validated dataclasses shared by every architecture."""
from __future__ import annotations

import dataclasses

ARCHS = ("llama", "gpt2")
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

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
