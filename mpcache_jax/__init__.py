"""The eviction core: fixed-capacity caches (`cache`), shared selection machinery
(`primitives`, `extent`), the attention seam (`attention`, `policy`) and the registered
policies (`policies`). It imports neither `models` nor `runtime` (see runtime/__init__.py for
the layers); a function that needs a model takes it as an argument."""
