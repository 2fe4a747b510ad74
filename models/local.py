"""Your own model: `--model=PATH` for a local GGUF file or Hugging Face LLaMA checkpoint directory.

    cfg = config("path/to/model.gguf", num_layers=4)   # geometry only (metadata / config.json)
    loaded = load("path/to/checkpoint_dir")             # catalog.LoadedModel(model, params, tok)

A GGUF file (its first bytes are b"GGUF") of the architectures llama.cpp calls `llama`, `qwen2`
and `gemma3`. The geometry comes from the llama.cpp metadata `<arch>.block_count`,
`.embedding_length`, `.feed_forward_length`, `.attention.head_count`, `.attention.head_count_kv`
(default: head_count), `.context_length` (the model's max_position), `.rope.freq_base`
(default 10000, llama.cpp's), `.attention.layer_norm_rms_epsilon` and `.attention.key_length`
(head_dim; default embedding_length / head_count); the vocabulary is the rows of
`token_embd.weight`; the LM head is `output.weight` when the file has it, else the embedding
(tied). Tensors of any type the `gguf` package dequantizes are read as float32.

- llama: llama.cpp's converter permutes the q/k rows of each head for its interleaved RoPE;
  they are put back in the half-split order our RoPE uses (`smollm2._unpermute_rope_rows`).
- qwen2: the llama block as it is (llama.cpp's qwen2 RoPE is the half-split one, so no
  permutation). Qwen2 has q/k/v projection biases and the llama block has none: a file
  whose biases are all zero loads (they are dropped); any non-zero bias is an error.
- gemma3: the conversion facts of `models.gemma3` (docs/models.md), which llama.cpp also
  hard-codes rather than reading them from the file: every sixth layer global, the others
  sliding-window layers of `gemma3.attention.sliding_window` tokens with RoPE base 10000,
  QK-norm, sandwich norms, embeddings times sqrt(hidden), tanh-GeLU, attention scaled by
  1 / sqrt(key_length); the file's norm weights already hold Gemma's 1 + w.

What the llama block cannot compute is refused before any weight is read, with one line
naming the file and the key or tensor: another architecture, RoPE scaling
(`<arch>.rope.scaling.*`), partial rotary dimensions, mixture-of-experts, per-layer head
counts, value heads of another width than key heads, and any tensor the loader would not
use (e.g. Llama 3.1's `rope_freqs.weight`) other than all-zero biases.

A Hugging Face directory: config.json with model_type "llama" (LlamaForCausalLM) and the
weights in `*.safetensors` (one file, or shards listed by model.safetensors.index.json), read
with the `safetensors` package (float32 / float16 / bfloat16; no torch). Linear weights are
stored (out, in) and transposed to our (in, out). Required config.json fields: hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, vocab_size, rms_norm_eps,
max_position_embeddings; optional: num_key_value_heads (default: heads), head_dim,
rope_theta or rope_parameters.rope_theta (default 10000), tie_word_embeddings (default
false, as transformers' LlamaConfig). hidden_act must be "silu", rope_scaling null (or
rope_parameters.rope_type "default"), attention_bias and mlp_bias false.

Tokenizer: from the GGUF's tokenizer metadata (`ChatTokenizer.from_gguf_reader`), or from the
directory's tokenizer.json (+ tokenizer_config.json: chat template, BOS / EOS;
`ChatTokenizer.from_hf_dir`); None when the file or directory has none (then only token ids
can be given to the model; the CLI's generate says it needs a tokenizer).

Nothing is cached: every load converts the file again (a local path needs no download, and
float32 conversion of a small model takes seconds). `num_layers` keeps the first layers.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import re

import numpy as np

from models.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

GGUF_ARCHS = ("llama", "qwen2", "gemma3")
GGUF_MAGIC = b"GGUF"
CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# llama.cpp's Gemma 3 facts (models/gemma3.py, docs/models.md): one global layer in six, the
# local layers' RoPE base.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
HF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "vocab_size", "rms_norm_eps", "max_position_embeddings")
_REQUIRED = object()


def is_path(name: str) -> bool:
    """Whether `--model=name` names a file or directory rather than a registered model: it
    contains a path separator, ends with .gguf, or exists."""
    name = os.fspath(name)
    return ("/" in name or os.sep in name or name.endswith(".gguf") or name.startswith("~")
            or os.path.exists(name))


def _one_line(err) -> str:
    return " ".join(str(err).split())


def _resolve(path) -> tuple[str, pathlib.Path]:
    """("gguf", file) or ("hf", directory); missing paths and unknown formats are errors."""
    path = pathlib.Path(os.fspath(path)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path} (--model=PATH takes a .gguf file "
                                "or a Hugging Face checkpoint directory holding config.json)")
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{path} has no {CONFIG_FILE}: a Hugging Face checkpoint "
                                    "directory needs config.json and *.safetensors")
        return "hf", path
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic == GGUF_MAGIC:
        return "gguf", path
    if path.name == CONFIG_FILE:
        return "hf", path.parent
    raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF'); --model=PATH "
                     "takes a .gguf file or a Hugging Face checkpoint directory")


def _check_layers(cfg: ModelConfig, num_layers: int | None, path) -> ModelConfig:
    if num_layers is None:
        return cfg
    if not 0 < num_layers <= cfg.num_layers:
        raise ConfigError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}] for {path}")
    try:
        return cfg.truncated(num_layers)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def config(path, num_layers: int | None = None) -> ModelConfig:
    """The checkpoint's ModelConfig (first `num_layers` layers), from metadata only."""
    kind, where = _resolve(path)
    if kind == "gguf":
        return _check_layers(_gguf_config(_open_gguf(where)), num_layers, where)
    return _check_layers(_hf_config(where)[0], num_layers, where)


def load(path, num_layers: int | None = None):
    """`catalog.LoadedModel(Model(cfg), params, tokenizer)` for a GGUF file or HF directory."""
    import jax
    import jax.numpy as jnp

    from models import catalog
    from models.gguf_store import flatten, llama_shapes
    from models.model import Model

    kind, where = _resolve(path)
    if kind == "gguf":
        reader = _open_gguf(where)
        full = _gguf_config(reader)
        cfg = _check_layers(full, num_layers, where)
        params = _gguf_params(reader, full, cfg.num_layers)
        tokenizer = _gguf_tokenizer(reader)
    else:
        full, hf = _hf_config(where)
        cfg = _check_layers(full, num_layers, where)
        params = _hf_params(where, cfg, hf)
        from models.tokenizer import ChatTokenizer
        tokenizer = ChatTokenizer.from_hf_dir(where)
    shapes = {name: tuple(np.shape(leaf)) for name, leaf in flatten(params).items()}
    expected = {**llama_shapes(cfg), "lm_head/kernel": (cfg.hidden_size, cfg.vocab_size)}
    if shapes != expected:
        differing = sorted(set(shapes.items()) ^ set(expected.items()))[:4]
        raise ValueError(f"{where}: the tensors do not match the geometry its "
                         f"{'metadata' if kind == 'gguf' else CONFIG_FILE} gives: {differing}")
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
    return catalog.LoadedModel(Model(cfg), params, tokenizer)


# ----- GGUF ------------------------------------------------------------------------------------
def _open_gguf(path: pathlib.Path):
    """A TensorReader on `path`. Parsing the metadata of a large vocabulary takes seconds
    (gemma3-270m: ~8 s), and get_config then load reads it twice: the last two readers are
    kept, keyed on the file's identity (device, inode, size, modification time)."""
    stat = path.stat()
    return _open_gguf_cached(str(path), (stat.st_dev, stat.st_ino, stat.st_size,
                                         stat.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _open_gguf_cached(path: str, identity: tuple):
    import gguf

    from models.gguf_store import TensorReader

    try:
        return TensorReader(gguf.GGUFReader(path))
    except (ValueError, IndexError, KeyError, OSError, TypeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file ({type(err).__name__}: "
                         f"{_one_line(err)})") from err


def _meta(reader, key: str, default=_REQUIRED, what: str = ""):
    field = reader.reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"{reader.path} has no {key!r} metadata{what}")
        return default
    return field.contents()


def _scalar(reader, key: str, kind, default=_REQUIRED):
    value = _meta(reader, key, default, " (needed for the model's geometry)")
    if isinstance(value, list):
        raise ValueError(f"{reader.path}: {key} differs per layer ({value[:4]}...); only one "
                         "value for every layer is supported")
    if kind is int and (isinstance(value, bool) or int(value) != value):
        raise ValueError(f"{reader.path}: {key}={value!r} must be an integer")
    if kind is float:
        # GGUF stores float32: the shortest decimal of that float32 is the value the converter
        # was given (1e-05, not 9.999999747378752e-06).
        return float(str(np.float32(value)))
    return kind(value)


def _refuse_what_we_cannot_compute(reader, arch: str) -> None:
    """One-line errors for metadata the llama block cannot honour."""
    path, prefix = reader.path, f"{arch}.rope.scaling."
    fields = reader.reader.fields
    scaling_type = _meta(reader, prefix + "type", None)
    if scaling_type is not None and scaling_type != "none":
        raise ValueError(f"{path}: {prefix}type={scaling_type!r}: RoPE scaling is not supported "
                         "(the llama block applies plain RoPE)")
    if scaling_type is None:   # llama.cpp reads the factor (linear scaling) without a type
        for key in sorted(k for k in fields if k.startswith(prefix)):
            value = fields[key].contents()
            if not (key == prefix + "factor" and float(value) in (0.0, 1.0)):
                raise ValueError(f"{path}: {key}={value!r}: RoPE scaling is not supported (the "
                                 "llama block applies plain RoPE)")
    experts = _meta(reader, f"{arch}.expert_count", 0)
    if experts:
        raise ValueError(f"{path}: {arch}.expert_count={experts}: mixture-of-experts layers are "
                         "not supported")


def _gguf_config(reader) -> ModelConfig:
    path = reader.path
    arch = _meta(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; --model=PATH "
                         f"reads the GGUF architectures {', '.join(GGUF_ARCHS)}")
    _refuse_what_we_cannot_compute(reader, arch)
    hidden = _scalar(reader, f"{arch}.embedding_length", int)
    heads = _scalar(reader, f"{arch}.attention.head_count", int)
    if heads <= 0 or hidden % heads and f"{arch}.attention.key_length" not in reader.reader.fields:
        raise ValueError(f"{path}: {arch}.embedding_length={hidden} is not a multiple of "
                         f"{arch}.attention.head_count={heads} and there is no "
                         f"{arch}.attention.key_length")
    head_dim = _scalar(reader, f"{arch}.attention.key_length", int, hidden // heads)
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        value = _scalar(reader, key, int, head_dim)
        if value != head_dim:
            what = ("value heads of another width than the key heads" if "value" in key else
                    "rotary embeddings over part of each head")
            raise ValueError(f"{path}: {key}={value} differs from the head dimension {head_dim}: "
                             f"{what} are not supported")
    if "token_embd.weight" not in reader.tensors:
        raise ValueError(f"{path} has no tensor 'token_embd.weight'")
    vocab, width = (int(n) for n in reversed(reader.tensors["token_embd.weight"].shape))
    if width != hidden:
        raise ValueError(f"{path}: token_embd.weight has rows of {width}, "
                         f"{arch}.embedding_length is {hidden}")
    layers = _scalar(reader, f"{arch}.block_count", int)
    fields = dict(
        arch="llama", name=path.name, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=_scalar(reader, f"{arch}.attention.head_count_kv", int, heads),
        head_dim=head_dim, intermediate_size=_scalar(reader, f"{arch}.feed_forward_length", int),
        max_position=_scalar(reader, f"{arch}.context_length", int),
        rope_theta=_scalar(reader, f"{arch}.rope.freq_base", float, 10000.0),
        norm_eps=_scalar(reader, f"{arch}.attention.layer_norm_rms_epsilon", float),
        tie_embeddings="output.weight" not in reader.tensors, activation="silu")
    if arch == "gemma3":
        # llama.cpp's attention scale is 1 / sqrt(key_length) except for the 62-layer 27B
        # (hidden / heads), whose linear RoPE scaling is refused above anyway.
        fields.update(
            activation="gelu_tanh",
            layer_types=tuple("global" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "local"
                              for i in range(layers)),
            sliding_window=_scalar(reader, "gemma3.attention.sliding_window", int),
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA, qk_norm=True, sandwich_norms=True,
            scale_embeddings=True, query_pre_attn_scalar=float(head_dim))
    try:
        cfg = ModelConfig(**fields)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    _check_tensor_names(reader, arch, cfg)
    return cfg


def _layer_tensors(arch: str) -> dict[str, str]:
    """GGUF tensor name within a block -> our module name (models/smollm2.py, models/gemma3.py)."""
    if arch == "gemma3":
        from models.gemma3 import _LAYER_TENSORS
    else:
        from models.smollm2 import _LAYER_TENSORS
    return _LAYER_TENSORS


_BIAS = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.bias")
_HINTS = {"rope_freqs.weight": "RoPE frequency factors (Llama 3.1-style RoPE scaling)"}


def _check_tensor_names(reader, arch: str, cfg: ModelConfig) -> None:
    """Every tensor of the file is one the loader reads, or an all-zero bias; every tensor it
    reads is there."""
    path = reader.path
    expected = {"token_embd.weight", "output_norm.weight"}
    if not cfg.tie_embeddings:
        expected.add("output.weight")
    for index in range(cfg.num_layers):
        expected.update(f"blk.{index}.{name}.weight" for name in _layer_tensors(arch))
    missing = sorted(expected - set(reader.tensors))
    if missing:
        raise ValueError(f"{path} has no tensor {missing[0]!r}" +
                         (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name in sorted(set(reader.tensors) - expected):
        if _BIAS.fullmatch(name):
            if np.any(reader.dense(name)):
                kind = "attention" if ".attn_" in name else "MLP"
                raise ValueError(
                    f"{path}: tensor {name!r} is non-zero: {arch}'s {kind} biases are not "
                    f"supported (the llama block has no {kind} biases)")
            continue
        hint = _HINTS.get(name, "not part of the llama block")
        raise ValueError(f"{path} holds tensor {name!r}, which the {arch} loader does not use "
                         f"({hint})")


def _gguf_params(reader, full: ModelConfig, num_layers: int) -> dict:
    from models.gguf_store import llama_tree
    from models.smollm2 import _unpermute_rope_rows

    arch = _meta(reader, "general.architecture")
    fix = None
    if arch == "llama":
        def fix(gguf_name: str, weight: np.ndarray) -> np.ndarray:
            if gguf_name == "attn_q":
                return _unpermute_rope_rows(weight, full.num_heads)
            if gguf_name == "attn_k":
                return _unpermute_rope_rows(weight, full.num_kv_heads)
            return weight
    params = llama_tree(reader, full.num_layers, num_layers, _layer_tensors(arch), fix)
    if not full.tie_embeddings:
        params["lm_head"] = {"kernel": np.ascontiguousarray(reader.dense("output.weight").T)}
    return params


def _gguf_tokenizer(reader):
    """ChatTokenizer from the tokenizer metadata, None without it."""
    from models.tokenizer import ChatTokenizer

    if "tokenizer.ggml.model" not in reader.reader.fields:
        log.warning("%s has no tokenizer metadata: the model takes token ids only", reader.path)
        return None
    if reader.reader.fields["tokenizer.ggml.model"].contents() == "gpt2":
        pre = _meta(reader, "tokenizer.ggml.pre", None)
        if pre not in (None, "default", "smollm"):
            log.warning("%s: tokenizer.ggml.pre=%r; the byte-level BPE is rebuilt with "
                        "SmolLM2's pre-tokenizer (digits one by one, then GPT-2's split), "
                        "which may split some text differently", reader.path, pre)
    return ChatTokenizer.from_gguf_reader(reader.reader)


# ----- Hugging Face directory --------------------------------------------------------------------
def _hf_config(directory: pathlib.Path) -> tuple[ModelConfig, dict]:
    file = directory / CONFIG_FILE
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON ({_one_line(err)})") from err
    if not isinstance(hf, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ValueError(f"{file}: model_type={model_type!r} is not supported; a checkpoint "
                         "directory must hold a LLaMA model (model_type 'llama'); GGUF files "
                         f"also take {', '.join(a for a in GGUF_ARCHS if a != 'llama')}")
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise ValueError(f"{file}: architectures={architectures}; LlamaForCausalLM is supported")
    for key in HF_REQUIRED:
        if hf.get(key) is None:
            raise ValueError(f"{file} has no {key!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{file}: hidden_act={act!r}; the llama block's MLP is SwiGLU ('silu')")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{file}: {key}=true; the llama block has no biases")
    if hf.get("rope_scaling") is not None:
        raise ValueError(f"{file}: rope_scaling={json.dumps(hf['rope_scaling'])}: RoPE scaling "
                         "is not supported (the llama block applies plain RoPE)")
    theta = hf.get("rope_theta")
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict):   # transformers 5 writes rope_parameters
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{file}: rope_parameters.rope_type={rope_type!r}: RoPE scaling is "
                             "not supported (the llama block applies plain RoPE)")
        theta = rope.get("rope_theta", theta)
    elif rope is not None:
        raise ValueError(f"{file}: rope_parameters={json.dumps(rope)} is not one set of "
                         "parameters for every layer")
    heads = hf["num_attention_heads"]
    try:
        cfg = ModelConfig(
            arch="llama", name=directory.name, vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim"),
            intermediate_size=hf["intermediate_size"],
            max_position=hf["max_position_embeddings"],
            rope_theta=float(10000.0 if theta is None else theta),
            norm_eps=float(hf["rms_norm_eps"]),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), activation="silu")
    except ConfigError as err:
        raise ConfigError(f"{file}: {err}") from None
    return cfg, hf


class _SafeTensors:
    """Tensors by name across a directory's *.safetensors files (numpy; bfloat16 widened to
    float32 without torch)."""

    def __init__(self, directory: pathlib.Path):
        from safetensors import safe_open

        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{index} has no readable weight_map ({_one_line(err)})") from err
            files = sorted({directory / name for name in weight_map.values()})
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory} has no *.safetensors weights (a PyTorch .bin "
                                    "checkpoint must be saved as safetensors first)")
        self.where: dict[str, pathlib.Path] = {}
        self._handles = {}
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists {file.name}, not found in {directory}")
            try:
                handle = safe_open(str(file), framework="numpy")
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(f"{file} is not a readable safetensors file "
                                 f"({_one_line(err)})") from err
            self._handles[file] = handle
            self.where.update({key: file for key in handle.keys()})

    def get(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in self.where:
            raise ValueError(f"the checkpoint has no tensor {key!r} (in "
                             f"{sorted({f.name for f in self.where.values()})})")
        file = self.where[key]
        handle = self._handles[file]
        dtype = handle.get_slice(key).get_dtype()
        if dtype == "BF16":
            value = self._bfloat16(file, key)
        elif dtype in ("F32", "F16", "F64"):
            value = handle.get_tensor(key)
        else:
            raise ValueError(f"{file}: tensor {key!r} is {dtype}; float32, float16 and bfloat16 "
                             "weights are supported")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{file}: tensor {key!r} has shape {tuple(value.shape)}, "
                             f"{CONFIG_FILE} gives {tuple(shape)}")
        return np.asarray(value, np.float32)

    @staticmethod
    def _bfloat16(file: pathlib.Path, key: str) -> np.ndarray:
        """A BF16 tensor from the file's header offsets: the upper half of a float32."""
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(size))[key]
            start, end = entry["data_offsets"]
            f.seek(8 + size + start)
            raw = np.frombuffer(f.read(end - start), np.dtype("<u2"))
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def _hf_params(directory: pathlib.Path, cfg: ModelConfig, hf: dict) -> dict:
    """Our parameter tree (numpy float32, lm_head tied or the checkpoint's) from the weights."""
    from models.model import tie_lm_head

    store = _SafeTensors(directory)
    D, F, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    used: set[str] = set()

    def get(key, shape):
        used.add(key)
        return store.get(key, shape)

    def kernel(key, n_in, n_out):
        return {"kernel": np.ascontiguousarray(get(key, (n_out, n_in)).T)}

    params = {"embed": {"embedding": get("model.embed_tokens.weight", (cfg.vocab_size, D))},
              "final_norm": {"scale": get("model.norm.weight", (D,))}}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        params[f"layers_{i}"] = {
            "input_norm": {"scale": get(p + "input_layernorm.weight", (D,))},
            "post_norm": {"scale": get(p + "post_attention_layernorm.weight", (D,))},
            "q_proj": kernel(p + "self_attn.q_proj.weight", D, cfg.num_heads * d),
            "k_proj": kernel(p + "self_attn.k_proj.weight", D, cfg.num_kv_heads * d),
            "v_proj": kernel(p + "self_attn.v_proj.weight", D, cfg.num_kv_heads * d),
            "o_proj": kernel(p + "self_attn.o_proj.weight", cfg.num_heads * d, D),
            "gate_proj": kernel(p + "mlp.gate_proj.weight", D, F),
            "up_proj": kernel(p + "mlp.up_proj.weight", D, F),
            "down_proj": kernel(p + "mlp.down_proj.weight", F, D),
        }
    if cfg.tie_embeddings:
        params = tie_lm_head(params)
        used.add("lm_head.weight")   # a tied checkpoint may store the copy too
    else:
        params["lm_head"] = kernel("lm_head.weight", D, cfg.vocab_size)
    later = re.compile(r"model\.layers\.(\d+)\.")
    unused = sorted(key for key in set(store.where) - used
                    if not key.endswith("rotary_emb.inv_freq")
                    and not ((m := later.match(key)) and int(m.group(1)) >= cfg.num_layers
                             and int(m.group(1)) < int(hf["num_hidden_layers"])))
    if unused:
        raise ValueError(f"{store.where[unused[0]]} holds tensor {unused[0]!r}"
                         + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
                         + ", which a LlamaForCausalLM checkpoint does not have")
    return params
