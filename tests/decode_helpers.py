"""Shared test driver: prefill a prompt, compress the cache with a policy, teacher-force steps."""
import numpy as np

from runtime.generate import compress_cache
from models import model as model_module


def teacher_forced_logits(model, params, tokens, policy, prompt_len, steps, *,
                          check_one_compile=False):
    """Prefill tokens[:prompt_len], compress with `policy`, then decode tokens[prompt_len:][:steps]
    one by one. Returns (logits [steps, V], final cache). With check_one_compile, asserts that
    the jitted decode step compiled at most once (on the first step) and was reused after."""
    cache = model.init_cache(prompt_len + steps)
    _, cache, aux = model.prefill(params, tokens[:prompt_len], cache,
                                  return_queries=policy.needs_queries)
    cache = compress_cache(policy, cache, aux, steps)
    out = []
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = model.decode_step(params, tokens[t], t, cache, policy)
        out.append(np.asarray(logits))
        if t == prompt_len:
            compiled = model_module._decode._cache_size()
    if check_one_compile:
        assert model_module._decode._cache_size() == compiled, f"{policy.name} recompiled"
    return np.stack(out), cache
