"""The runtime: what runs a model with a policy, above `models` and the eviction core.

    mpcache_jax   eviction core: cache, primitives, attention seam, policies (no model import)
      <- models   Flax decoders, configs, the registry, weight loading, tokenizers
      <- runtime  step programs and their visibility (`programs`), plaintext generation
                  (`generate`), secure backends and sessions (`mpc`), parties on hosts
                  (`distributed`)
      <- experiments

A lower layer never imports a higher one; where it needs something from above (a model), it
takes it as an argument.
"""
