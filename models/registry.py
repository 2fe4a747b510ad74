"""Model registry: `--model=NAME` -> configuration, parameters and (when available) tokenizer.

`--model=PATH` (a .gguf file or a Hugging Face LLaMA checkpoint directory) goes to
`models.local` instead: geometry from the file's own metadata, converted on every load."""
from __future__ import annotations

from typing import Callable, Sequence

from models import catalog, local
from models.catalog import (GEMMA3_270M, GPT2, GPT2_TINY, LLAMA2_D1024,  # noqa: F401
                            LLAMA_TINY, MODEL_NAMES, SMOLLM2_135M, LoadedModel, pick_layers)
from models.config import ConfigError, ModelConfig
from models.model import Model


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


def _load_gemma3(cfg: ModelConfig, seed: int, cache_dir: str | None = None,
                 num_layers: int | None = None, **_) -> LoadedModel:
    from models import gemma3
    return gemma3.load(cache_dir=cache_dir, num_layers=num_layers)


_LOADERS: dict[str, Callable[..., LoadedModel]] = {
    "smollm2-135m": _load_smollm2,
    "gemma3-270m": _load_gemma3,
    "gpt2": _load_gpt2,
    "llama2-d1024": _load_random,
    "llama-tiny": _load_random,
    "gpt2-tiny": _load_random,
}
assert tuple(_LOADERS) == MODEL_NAMES, "every registered geometry needs a loader"


def is_local(name: str) -> bool:
    """Whether `name` is a path (`models.local`) rather than a registered model name."""
    return name not in MODEL_NAMES and local.is_path(name)


def get_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The registered configuration, or a local checkpoint's (`models.local.config`: read
    from its metadata), optionally truncated to its first `num_layers` layers."""
    if is_local(name):
        return local.config(name, num_layers)
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown model {name!r}; registered models: {', '.join(MODEL_NAMES)}; "
                          "or a path: a .gguf file or a Hugging Face checkpoint directory")
    return catalog.get_config(name, num_layers)


def is_cached(name: str, cache_dir: str | None = None) -> bool:
    """Whether `name`'s real weights are on this machine already (its GGUF in the cache dir, or
    a local path that exists): loading them downloads nothing. False for the random-weight
    geometries."""
    import importlib
    import os

    from models.gguf_store import cache_root
    if is_local(name):
        return os.path.exists(os.path.expanduser(name))
    module = {"smollm2-135m": "models.smollm2", "gemma3-270m": "models.gemma3"}.get(name)
    if module is None:
        return False
    store = importlib.import_module(module).STORE
    return (cache_root(cache_dir) / store.gguf_name).is_file()


def load(name: str, *, weights_path: str | None = None, cache_dir: str | None = None,
         seed: int = 0, num_layers: int | None = None,
         layers: Sequence[int] | None = None) -> LoadedModel:
    """Configuration + parameters (+ tokenizer) for a registered model name or a local path
    (`models.local`: a .gguf file or a Hugging Face LLaMA directory; `seed` and `cache_dir`
    do not apply): the first `num_layers` layers, or the layers listed in `layers`
    (increasing indices, e.g. [4, 5, 10, 11] of gemma3-270m: two local and two global
    layers), or all of them."""
    if layers is not None and num_layers is not None:
        raise ConfigError(f"give num_layers={num_layers} or layers={list(layers)}, not both")
    if layers is not None:
        if not len(layers):
            raise ConfigError("layers=[] keeps no layer; list the layer indices to keep")
        return pick_layers(load(name, weights_path=weights_path, cache_dir=cache_dir, seed=seed),
                           layers)
    if is_local(name):
        if weights_path:
            raise ConfigError(f"--weights_path={weights_path} is for --model=gpt2; --model={name} "
                              "names the checkpoint itself")
        return local.load(name, num_layers=num_layers)
    if name == "gpt2" and weights_path:
        cfg = get_config(name)  # the checkpoint's config.json decides depth and width
    else:
        cfg = get_config(name, num_layers)
    return _LOADERS[name](cfg, seed=seed, weights_path=weights_path, cache_dir=cache_dir,
                          num_layers=num_layers)
