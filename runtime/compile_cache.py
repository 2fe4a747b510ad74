"""JAX's persistent compilation cache for command-line runs.

A program compiled once (a prefill of one prompt shape, a policy's decode loop) is written to
`<project cache>/xla/` and read back by later processes instead of compiled again: a second
run of the same shapes compiles nothing. The project cache is --cache_dir, else
$MPCACHE_CACHE_DIR, else ~/.cache/mpcache_jax (where the models' checkpoints live too).
`mpcache run` turns it on unless --nocompile_cache; the library itself never
does (a caller decides where compiled programs go).
"""
from __future__ import annotations

import pathlib

# Compilations shorter than this are not written (the cache would fill with programs that are
# cheaper to compile than to read).
MIN_COMPILE_SECONDS = 0.5


def enable(cache_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Turn the persistent compilation cache on in `cache_dir`/xla (default: the project cache)
    and return that directory."""
    import jax
    from models.gguf_store import default_cache_dir
    path = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
    path = path.expanduser() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path
