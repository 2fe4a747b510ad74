"""Does SPU's simulated communication count change when the same program runs again?

    python -m experiments.repeat_noise_bench

Runs Table 2's token-level one-hot gather (256 of 1024 rows of a 1024 x 128 secret key cache,
secret indices; ABY3) several times in one process, with a fixed-point and with an integer
one-hot, and prints every party's sent bytes and their sum per run. The parties do not send
equal amounts: several ABY3 kernels are asymmetric and most draw the roles anew on every call
(B2A by OT, eqz, TruncAPr2; MulA1B has fixed senders), so one party's bytes change from run to
run (which is why party 0's bytes x 3, the former estimate, reported 21-122 MB for this
gather), while the sum over the parties -- `comm_bytes` now -- is the same in every run and
equals the sum received.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mpcache_jax import primitives as P
from mpcache_jax.mpc import backends as B
from mpcache_jax.mpc.config import MPCConfig
from mpcache_jax.mpc.costs import cost_fields


def main(repeats: int = 4) -> None:
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
    print("MB sent per party (p0 p1 p2), their sum = comm_bytes, the sum received, messages "
          "(send actions per party, mean)")
    for name, fn in variants.items():
        program = backend.compile(fn, (idx, keys), (B.SECRET, B.SECRET))
        totals = []
        print(name)
        for rep in range(repeats):
            _, cost, wall = backend.run(program, backend.share(idx, B.SECRET),
                                        backend.share(keys, B.SECRET))
            rec = cost_fields(cost, wall, backend.world)
            sent = [b / 1e6 for b in rec["party_send_bytes"]]
            totals.append(rec["comm_bytes"])
            print(f"  run {rep}: per party " + " ".join(f"{mb:7.2f}" for mb in sent)
                  + f"   sum {rec['comm_bytes'] / 1e6:7.2f}   received "
                  f"{sum(rec['party_recv_bytes']) / 1e6:7.2f}   messages {rec['messages']:3d} "
                  f"(per party {rec['party_send_actions']})   [{rec['party_attribution']}]")
        same = "the same in every run" if len(set(totals)) == 1 else "NOT the same in every run"
        print(f"  sum over parties: {min(totals) / 1e6:.2f}-{max(totals) / 1e6:.2f} MB, {same}")


if __name__ == "__main__":
    main()
