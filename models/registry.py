"""Model registry: `--model=NAME` -> configuration, parameters and (when available) tokenizer."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from models.config import ConfigError, ModelConfig
from models.model import Model

# GPT-2 small geometry (124M), as in Hugging Face's `gpt2`.
GPT2 = ModelConfig(arch="gpt2", name="gpt2", vocab_size=50257, hidden_size=768, num_layers=12,
                   num_heads=12, num_kv_heads=12, intermediate_size=3072, max_position=1024,
                   norm_eps=1e-5, activation="gelu_tanh", tie_embeddings=True)

# SmolLM2-135M-Instruct (LLaMA architecture with GQA), see ../shared/STACK.md.
SMOLLM2_135M = ModelConfig(arch="llama", name="smollm2-135m", vocab_size=49152, hidden_size=576,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           intermediate_size=1536, max_position=8192, rope_theta=100000.0,
                           norm_eps=1e-5, tie_embeddings=True, activation="silu")

# LLaMA-2-7B's configuration with the hidden size reduced to 1024 (MPCache's efficiency model,
# paper Section 5.1): every other field keeps LLaMA-2's value, so 32 heads of dim 32.
LLAMA2_D1024 = ModelConfig(arch="llama", name="llama2-d1024", vocab_size=32000, hidden_size=1024,
                           num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=11008,
                           max_position=4096, rope_theta=10000.0, norm_eps=1e-5,
                           tie_embeddings=False, activation="silu")

LLAMA_TINY = ModelConfig(arch="llama", name="llama-tiny", vocab_size=256, hidden_size=64,
                         num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         max_position=4096, rope_theta=10000.0, tie_embeddings=True)

GPT2_TINY = ModelConfig(arch="gpt2", name="gpt2-tiny", vocab_size=256, hidden_size=64,
                        num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256,
                        max_position=4096, activation="gelu_tanh", tie_embeddings=True)


@dataclasses.dataclass
class LoadedModel:
    model: Model
    params: dict
    tokenizer: Any = None  # models.tokenizer.ChatTokenizer or None for random-weight models


def _load_random(cfg: ModelConfig, seed: int, **_) -> LoadedModel:
    """Random weights of the registered geometry (truncated to `num_layers` when given)."""
    model = Model(cfg)
    return LoadedModel(model, model.init_params(seed))


def _load_gpt2(cfg: ModelConfig, seed: int, weights_path: str | None = None,
               num_layers: int | None = None, **_) -> LoadedModel:
    """HF-format weights when given (their own config.json decides the geometry), else random."""
    if not weights_path:
        return _load_random(cfg, seed)
    from models import hf_gpt2
    return hf_gpt2.load(weights_path, num_layers=num_layers)


def _load_smollm2(cfg: ModelConfig, seed: int, cache_dir: str | None = None,
                  num_layers: int | None = None, **_) -> LoadedModel:
    from models import smollm2
    return smollm2.load(cache_dir=cache_dir, num_layers=num_layers)


_REGISTRY: dict[str, tuple[ModelConfig, Callable[..., LoadedModel]]] = {
    "smollm2-135m": (SMOLLM2_135M, _load_smollm2),
    "gpt2": (GPT2, _load_gpt2),
    "llama2-d1024": (LLAMA2_D1024, _load_random),
    "llama-tiny": (LLAMA_TINY, _load_random),
    "gpt2-tiny": (GPT2_TINY, _load_random),
}
MODEL_NAMES = tuple(_REGISTRY)


def get_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The registered configuration, optionally truncated to its first `num_layers` layers."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model {name!r}; registered models: {', '.join(MODEL_NAMES)}")
    cfg = _REGISTRY[name][0]
    if num_layers is not None:
        if not 0 < num_layers <= cfg.num_layers:
            raise ConfigError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}] for {name}")
        cfg = cfg.replace(num_layers=num_layers)
    return cfg


def load(name: str, *, weights_path: str | None = None, cache_dir: str | None = None,
         seed: int = 0, num_layers: int | None = None) -> LoadedModel:
    """Configuration + parameters (+ tokenizer) for a registered model name."""
    if name == "gpt2" and weights_path:
        cfg = get_config(name)  # the checkpoint's config.json decides depth and width
    else:
        cfg = get_config(name, num_layers)
    return _REGISTRY[name][1](cfg, seed=seed, weights_path=weights_path, cache_dir=cache_dir,
                              num_layers=num_layers)
