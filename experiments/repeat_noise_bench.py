"""How much SPU's simulated communication count varies when the same program runs again.

    python -m experiments.repeat_noise_bench

Runs Table 2's token-level one-hot gather (256 of 1024 rows of a 1024 x 128 secret key cache,
secret indices; ABY3) three times in one process, with a fixed-point and with an integer
one-hot, and prints the bytes of every run. Identical programs on identical inputs report
different byte counts (a few discrete values, 21-122 MB seen for this gather), so a single
measurement of a large matmul is not exact. The cause is not established; one suspect is that
`comm_bytes` = party 0's sent bytes x parties assumes every party sends the same amount.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mpcache_jax import primitives as P
from mpcache_jax.mpc import backends as B
from mpcache_jax.mpc.config import MPCConfig


def main(repeats: int = 3) -> None:
    T, d = 1024, 128
    rng = np.random.RandomState(0)
    keys = rng.randn(T, d).astype(np.float32)
    idx = np.sort(rng.choice(T, T // 4, replace=False)).astype(np.int32)
    backend = B.make_backend("spu_sim", MPCConfig(protocol="ABY3"))
    variants = {
        "fixed-point one-hot @ K": lambda i, K: P.indices_onehot(i, T, K.dtype) @ K,
        "integer one-hot (gather_rows)": lambda i, K: P.gather_rows(
            P.indices_onehot(i, T, jnp.int32), K),
    }
    for name, fn in variants.items():
        program = backend.compile(fn, (idx, keys), (B.SECRET, B.SECRET))
        mbs = []
        for _ in range(repeats):
            _, cost, _ = backend.run(program, backend.share(idx, B.SECRET),
                                     backend.share(keys, B.SECRET))
            mbs.append(cost.send_bytes * 3 / 1e6)
        print(f"{name:<30} " + " ".join(f"{mb:7.2f}" for mb in mbs) + f"  MB (min {min(mbs):.2f})")


if __name__ == "__main__":
    main()
