"""The registered model geometries, `get_config` and `LoadedModel`.

Kept apart from `models.registry` (which adds the loaders) so that the loaders in
`models.smollm2` and `models.hf_gpt2` can use them without importing the registry.
"""
from __future__ import annotations

import dataclasses
from typing import Any

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

# Gemma 3 270M (pretrained base model): the GGUF metadata gives the geometry; the facts it
# leaves out (which layers are local, the local RoPE base, the attention scale) are those of
# llama.cpp's and transformers' Gemma 3 (docs/models.md lists where each was read). Every
# sixth layer (5, 11, 17) is global; the GGUF's norm weights already hold Gemma's 1 + w.
GEMMA3_270M = ModelConfig(arch="llama", name="gemma3-270m", vocab_size=262144, hidden_size=640,
                          num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
                          intermediate_size=2048, max_position=32768, rope_theta=1000000.0,
                          norm_eps=1e-6, tie_embeddings=True, activation="gelu_tanh",
                          layer_types=tuple("global" if (i + 1) % 6 == 0 else "local"
                                            for i in range(18)),
                          sliding_window=512, rope_local_theta=10000.0, qk_norm=True,
                          sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=256.0)

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


def pick_layers(loaded: LoadedModel, layers) -> LoadedModel:
    """A LoadedModel of the given layers of `loaded` (model order kept, renumbered from 0),
    with their local/global types: e.g. [4, 5] of gemma3-270m is one local and one global
    layer of the real weights (tests and cost runs on reduced models)."""
    cfg = loaded.model.cfg
    layers = [int(i) for i in layers]
    if not layers or sorted(set(layers)) != layers or not 0 <= layers[0] <= layers[-1] < cfg.num_layers:
        raise ValueError(f"layers={layers} must be increasing indices in [0, {cfg.num_layers})")
    types = None if cfg.layer_types is None else tuple(cfg.layer_types[i] for i in layers)
    window = cfg.sliding_window if types is not None and "local" in types else None
    small = cfg.replace(num_layers=len(layers), layer_types=types, sliding_window=window,
                        name=f"{cfg.name}-layers{'-'.join(map(str, layers))}")
    params = {name: value for name, value in loaded.params.items()
              if not name.startswith("layers_")}
    params.update({f"layers_{new}": loaded.params[f"layers_{old}"]
                   for new, old in enumerate(layers)})
    return LoadedModel(Model(small), params, loaded.tokenizer)


CONFIGS: dict[str, ModelConfig] = {cfg.name: cfg for cfg in
                                   (SMOLLM2_135M, GEMMA3_270M, GPT2, LLAMA2_D1024, LLAMA_TINY,
                                    GPT2_TINY)}
MODEL_NAMES = tuple(CONFIGS)


def get_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The registered configuration, optionally truncated to its first `num_layers` layers."""
    if name not in CONFIGS:
        raise ConfigError(f"unknown model {name!r}; registered models: {', '.join(MODEL_NAMES)}")
    cfg = CONFIGS[name]
    if num_layers is not None:
        if not 0 < num_layers <= cfg.num_layers:
            raise ConfigError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}] for {name}")
        cfg = cfg.truncated(num_layers)
    return cfg
