"""Load a Hugging Face GPT-2 checkpoint (config.json + model.safetensors) into our parameter tree.

    loaded = hf_gpt2.load("path/to/gpt2")         # directory with config.json, model.safetensors
    loaded = hf_gpt2.load("path/to/model.safetensors", num_layers=6)   # config.json alongside

Only local files are read; nothing is fetched from a model hub. `safetensors` is read with
`safetensors.numpy`; a `pytorch_model.bin` is read only when torch happens to be installed.
Hugging Face's GPT-2 uses `Conv1D` layers whose weights are already (in, out), the layout of
our kernels, so no weight is transposed.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from models.config import ConfigError, ModelConfig
from models.model import Model, tie_lm_head
from models.catalog import LoadedModel

# config.json `activation_function` -> our activation name.
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "silu": "silu",
    "swish": "silu",
}


# ------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------
def config_from_hf(hf_config: Mapping[str, Any], *, name: str = "gpt2") -> ModelConfig:
    """Our `ModelConfig` for a Hugging Face GPT-2 `config.json` (as a dict)."""
    model_type = hf_config.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ConfigError(f"config.json has model_type={model_type!r}; this loader reads GPT-2 "
                          "checkpoints (model_type 'gpt2') only")
    missing = [key for key in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")
               if hf_config.get(key) is None]
    if missing:
        raise ConfigError(f"GPT-2 config.json lacks {', '.join(missing)}")
    act = hf_config.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ConfigError(f"GPT-2 activation_function={act!r} is not supported; supported: "
                          f"{', '.join(sorted(_ACTIVATIONS))}")
    if not hf_config.get("scale_attn_weights", True):
        raise ConfigError("scale_attn_weights=false (unscaled attention scores) is not supported")
    if hf_config.get("scale_attn_by_inverse_layer_idx", False):
        raise ConfigError("scale_attn_by_inverse_layer_idx=true is not supported")
    if hf_config.get("add_cross_attention", False):
        raise ConfigError("add_cross_attention=true (encoder-decoder GPT-2) is not supported")
    hidden = hf_config["n_embd"]
    inner = hf_config.get("n_inner")
    return ModelConfig(
        arch="gpt2",
        name=name,
        vocab_size=hf_config["vocab_size"],
        hidden_size=hidden,
        num_layers=hf_config["n_layer"],
        num_heads=hf_config["n_head"],
        num_kv_heads=hf_config["n_head"],
        intermediate_size=4 * hidden if inner is None else inner,
        max_position=hf_config["n_positions"],
        norm_eps=float(hf_config.get("layer_norm_epsilon", 1e-5)),
        activation=_ACTIVATIONS[act],
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", True)),
    )


# ------------------------------------------------------------------------------------------
# parameters
# ------------------------------------------------------------------------------------------
def _prefix(state_dict: Mapping[str, Any]) -> str:
    """'transformer.' for GPT2LMHeadModel checkpoints, '' for bare GPT2Model ones."""
    if "transformer.wte.weight" in state_dict:
        return "transformer."
    if "wte.weight" in state_dict:
        return ""
    raise ValueError("no token embedding found: expected tensor 'transformer.wte.weight' (or "
                     "'wte.weight') in the GPT-2 state dict; is this a GPT-2 checkpoint?")


def params_from_state_dict(state_dict: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Our GPT-2 parameter tree from a transformers GPT-2 state dict (numpy arrays).

    Reads layers [0, cfg.num_layers) (so a truncated cfg loads the first layers only); the LM
    head is tied to the token embedding unless cfg.tie_embeddings is false, in which case
    `lm_head.weight` [V, D] is read.
    """
    if cfg.arch != "gpt2":
        raise ConfigError(f"params_from_state_dict needs a gpt2 config, got arch={cfg.arch!r}")
    prefix = _prefix(state_dict)
    D, V, P, I = cfg.hidden_size, cfg.vocab_size, cfg.max_position, cfg.intermediate_size

    def get(name: str, shape: tuple[int, ...], full_name: bool = False) -> jnp.ndarray:
        key = name if full_name else prefix + name
        if key not in state_dict:
            raise ValueError(f"missing tensor {key!r} (expected shape {shape}) in the GPT-2 "
                             "checkpoint")
        value = np.asarray(state_dict[key])
        if tuple(value.shape) != shape:
            raise ValueError(f"tensor {key!r} has shape {tuple(value.shape)}, expected {shape} "
                             f"for {cfg.name} (hidden {D}, vocab {V}, positions {P}, MLP {I})")
        return jnp.asarray(value.astype(np.float32))

    def norm(name: str) -> dict:
        return {"scale": get(f"{name}.weight", (D,)), "bias": get(f"{name}.bias", (D,))}

    def dense(name: str, n_in: int, n_out: int) -> dict:
        return {"kernel": get(f"{name}.weight", (n_in, n_out)), "bias": get(f"{name}.bias", (n_out,))}

    params: dict[str, Any] = {
        "embed": {"embedding": get("wte.weight", (V, D))},
        "pos_embed": {"embedding": get("wpe.weight", (P, D))},
    }
    for i in range(cfg.num_layers):
        h = f"h.{i}"
        params[f"layers_{i}"] = {
            "input_norm": norm(f"{h}.ln_1"),
            "qkv_proj": dense(f"{h}.attn.c_attn", D, 3 * D),
            "o_proj": dense(f"{h}.attn.c_proj", D, D),
            "post_norm": norm(f"{h}.ln_2"),
            "fc_in": dense(f"{h}.mlp.c_fc", D, I),
            "fc_out": dense(f"{h}.mlp.c_proj", I, D),
        }
    params["final_norm"] = norm("ln_f")
    if cfg.tie_embeddings:
        return tie_lm_head(params)
    head = get("lm_head.weight", (V, D), full_name=True)
    params["lm_head"] = {"kernel": jnp.asarray(np.ascontiguousarray(np.asarray(head).T))}
    return params


# ------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------
def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    try:
        return load_file(str(path))
    except (TypeError, ValueError) as err:  # e.g. bfloat16, which numpy cannot represent
        try:
            import torch  # noqa: F401
            from safetensors.torch import load_file as load_torch
        except ImportError:
            raise ValueError(f"cannot read {path} with safetensors.numpy ({err}); store the "
                             "weights as float32/float16 or install torch") from err
        return {k: v.float().numpy() for k, v in load_torch(str(path)).items()}


def _read_sharded_safetensors(index_path: pathlib.Path) -> dict[str, np.ndarray]:
    with open(index_path) as f:
        weight_map = json.load(f).get("weight_map", {})
    state: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise FileNotFoundError(f"{index_path} lists shard {shard!r}, not found at {shard_path}")
        state.update(_read_safetensors(shard_path))
    return state


def _read_torch_bin(path: pathlib.Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as err:
        raise ValueError(f"{path} is a PyTorch checkpoint and torch is not installed; convert it "
                         "to model.safetensors (safetensors is read without torch)") from err
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    return {k: v.detach().float().numpy() for k, v in state.items() if hasattr(v, "detach")}


def _read_weights(path: pathlib.Path) -> dict[str, np.ndarray]:
    if path.name.endswith(".safetensors.index.json"):
        return _read_sharded_safetensors(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return _read_torch_bin(path)
    raise ValueError(f"unrecognised weights file {path}: expected .safetensors or .bin")


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _locate(weights_path: str | os.PathLike) -> tuple[pathlib.Path, pathlib.Path]:
    """(config.json, weights file) for a checkpoint directory or a weights file."""
    path = pathlib.Path(weights_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"GPT-2 weights path {path} does not exist; pass a directory "
                                "holding config.json and model.safetensors")
    if path.is_dir():
        directory = path
        for candidate in _WEIGHT_FILES:
            if (path / candidate).is_file():
                weights = path / candidate
                break
        else:
            raise FileNotFoundError(f"no weights in {path}: expected one of {', '.join(_WEIGHT_FILES)}")
    else:
        directory, weights = path.parent, path
    config = directory / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"missing {config}: a GPT-2 checkpoint needs its Hugging Face "
                                "config.json next to the weights")
    return config, weights


class GPT2Tokenizer:
    """A `tokenizer.json` behind `models.tokenizer.ChatTokenizer`'s interface (encode, decode,
    eos_id, stop_ids, apply_chat_template, encode_chat).

    GPT-2 has no chat template: the chat entry points join the message texts with blank lines
    and tokenize that plain text.
    """

    def __init__(self, tokenizer, eos_id: int | None):
        self._tok = tokenizer
        self.eos_id = eos_id
        self.stop_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eos_id: int | None = None) -> "GPT2Tokenizer":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(path))
        end = tok.token_to_id("<|endoftext|>")
        if end is not None:
            eos_id = end
        elif eos_id is not None and eos_id >= tok.get_vocab_size(with_added_tokens=True):
            eos_id = None
        return cls(tok, eos_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """Plain text: each message's content (a str counts as one user message), separated
        by blank lines. There is no template, so no role markers and no generation prompt."""
        del add_generation_prompt
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        for message in messages:
            if "content" not in message:
                raise ValueError(f"each message needs 'content', got {message!r}")
        return "\n\n".join(m["content"] for m in messages)

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        """Token ids of the system prompt (if any) and the user text as plain text."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": user_text})
        return self.encode(self.apply_chat_template(messages))

    # The chat entry points above stand in for a template (ChatTokenizer's interface).
    has_chat_template = True

    def encode_prompt(self, text: str) -> list[int]:
        """Plain-text prompt ids (GPT-2 adds no BOS)."""
        return self.encode(text)

    def encode_request(self, text: str, chat: bool = True, system: str | None = None) -> list[int]:
        return self.encode_chat(text, system=system) if chat else self.encode_prompt(text)


def load(weights_path: str | os.PathLike, num_layers: int | None = None) -> LoadedModel:
    """A GPT-2 checkpoint from local files: model, float32 parameters and (if present) tokenizer.

    `weights_path`: a directory with config.json and model.safetensors (or
    model.safetensors.index.json, or pytorch_model.bin), or a weights file with config.json in
    the same directory. `num_layers` keeps only the first layers.
    """
    config_path, weights_file = _locate(weights_path)
    with open(config_path) as f:
        hf_config = json.load(f)
    cfg = config_from_hf(hf_config)
    if num_layers is not None:
        if not 0 < num_layers <= cfg.num_layers:
            raise ConfigError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}]: the "
                              f"checkpoint {weights_file} has {cfg.num_layers} layers")
        cfg = cfg.replace(num_layers=num_layers)
    params = params_from_state_dict(_read_weights(weights_file), cfg)
    tokenizer_path = config_path.parent / "tokenizer.json"
    tokenizer = None
    if tokenizer_path.is_file():
        eos = hf_config.get("eos_token_id")
        tokenizer = GPT2Tokenizer.from_file(tokenizer_path, eos if isinstance(eos, int) else None)
    return LoadedModel(Model(cfg), params, tokenizer)
