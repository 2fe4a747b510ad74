"""One-hot gather under SPU ABY3: fixed-point vs integer one-hot (a lead for issue 5).

    python -m experiments.gather_dtype_bench

Gathers 12 of 32 clusters (16 tokens x 32 dims each) for 32 heads, as MPCache's cluster gather
at T = 2048 with a 25% static keep. A fixed-point x fixed-point matmul truncates every output
element; with the one-hot as integers (from a comparison) the product needs no truncation.
Casting a fixed-point one-hot to int is itself a truncation, so the integer one-hot has to
come from the comparison that builds it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import primitives as P
from mpcache_jax.mpc import backends as B
from mpcache_jax.mpc.config import MPCConfig
from mpcache_jax.mpc.costs import cost_fields

BATCHED = (((2,), (1,)), ((0,), (0,)))


def main() -> None:
    heads, k, clusters, row = 32, 12, 32, 16 * 32
    rng = np.random.RandomState(0)
    onehot = np.zeros((heads, k, clusters), np.float32)
    for h in range(heads):
        onehot[h, np.arange(k), rng.choice(clusters, k, replace=False)] = 1.0
    x = rng.randn(heads, clusters, row).astype(np.float32)
    want = np.einsum("hkc,hcd->hkd", onehot, x)
    variants = {
        "fixed-point one-hot": lambda o, v: jnp.einsum("hkc,hcd->hkd", o, v),
        "cast fixed-point -> int": lambda o, v: jax.lax.dot_general(
            o.astype(jnp.int32), v, BATCHED, preferred_element_type=jnp.float32),
        "int one-hot from a comparison": lambda o, v: jax.lax.dot_general(
            (o > 0.5).astype(jnp.int32), v, BATCHED, preferred_element_type=jnp.float32),
        # primitives.gather_rows: the same integer one-hot, block-diagonal 2-D matmul (1 round
        # instead of one per head)
        "gather_rows (block-diagonal)": lambda o, v: P.gather_rows(o, v),
    }
    backend = B.make_backend("spu_sim", MPCConfig(protocol="ABY3"))
    base = None
    for name, fn in variants.items():
        program = backend.compile(fn, (onehot, x), B.SECRET)
        out, cost, _ = backend.run(program, *backend.share((onehot, x), B.SECRET))
        err = float(np.abs(np.asarray(backend.reveal(out)) - want).max())
        rec = cost_fields(cost, 0.0, backend.world)   # bytes sent summed over the parties
        mb = rec["comm_bytes"] / 1e6
        base = base or mb
        print(f"{name:<32} {mb:8.2f} MB  {rec['messages']:5d} msgs  {base / mb:5.2f}x  max err {err:.1e}")


if __name__ == "__main__":
    main()
