"""Evaluation without per-token host round trips: the layers as one loop, the decode loop on
the device, batches of samples, the persistent compilation cache, a plaintext path without SPU.
Each is checked against the straightforward computation it replaces."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import REPO_ROOT
from models import registry, transformer
from mpcache_jax.cache import LayerStack
from mpcache_jax.policies import make_policy
from runtime.generate import (SamplingConfig, apply_policy, decode_loop_batch, decode_tokens,
                              prefill_prompt, sample_token, stack_samples, take_sample)


@pytest.fixture(scope="module")
def tiny():
    """llama-tiny with O(1) activations (the 0.02 init gives near-constant logits)."""
    lm = registry.load("llama-tiny")
    params = jax.tree_util.tree_map(lambda p: p * 6.0 if p.ndim == 2 else p, lm.params)
    params["lm_head"] = {"kernel": params["embed"]["embedding"].T}
    return lm.model, params


def _host_loop(model, params, logits, cache, policy, start, steps, sampling, stop_ids=()):
    """The per-token host loop the device loop replaces (model.decode_step each step)."""
    key = jax.random.PRNGKey(sampling.seed)
    tokens, rows = [], []
    for step in range(steps):
        key, sub = jax.random.split(key)
        rows.append(np.asarray(logits))
        token = int(sample_token(logits, sub, sampling.temperature, sampling.top_p))
        tokens.append(token)
        if token in stop_ids or step + 1 == steps:
            break
        logits, cache = model.decode_step(params, token, start + step, cache, policy)
    return tokens, np.stack(rows)


def _fed_then_greedy(model, params, logits, cache, policy, start, fed, n_forced, limit,
                     stop_id=None):
    """Host mirror of a batch loop's sample: `fed` tokens for the first n_forced steps, then
    greedy, `limit` steps, a stop token ending a free step -> (tokens, logits rows, stopped)."""
    tokens, rows = [], []
    for step in range(limit):
        rows.append(np.asarray(logits))
        free = step >= n_forced
        token = int(jnp.argmax(logits)) if free else int(fed[step])
        tokens.append(token)
        if free and token == stop_id:
            return tokens, np.stack(rows), True
        logits, cache = model.decode_step(params, token, start + step, cache, policy)
    return tokens, np.stack(rows), False


def _bucketed_batch(model, params, policy, rng, lengths, bucket, steps):
    """Prompts of `lengths` random tokens prefilled into `bucket` and compressed as one batch
    -> (prompts, per-sample prefill outputs, the batch's cache)."""
    from runtime.generate import compress_batch
    prompts = [list(rng.randint(0, 256, n)) for n in lengths]
    outs = [prefill_prompt(model, params, p, steps, False, bucket=bucket) for p in prompts]
    cache = compress_batch(policy, stack_samples([o[1] for o in outs]),
                           stack_samples([o[2] for o in outs]), steps)
    return prompts, outs, cache


@pytest.mark.parametrize("name", ["full", "mpcache", "h2o", "quest"])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_device_loop_equals_the_host_loop(tiny, name, temperature):
    model, params = tiny
    prompt = list(np.random.RandomState(0).randint(0, 256, 150))
    policy = make_policy(name, 0.3)
    sampling = SamplingConfig(temperature=temperature, seed=3)
    logits, dense, aux = prefill_prompt(model, params, prompt, 12, policy.needs_queries)
    want, want_rows = _host_loop(model, params, logits, apply_policy(policy, dense, aux, 12),
                                 policy, len(prompt), 12, sampling)
    got = decode_tokens(model, params, logits, apply_policy(policy, dense, aux, 12),
                        policy=policy, start_pos=len(prompt), max_new_tokens=12,
                        sampling=sampling, keep_logits=True)
    assert got.tokens == want
    np.testing.assert_allclose(np.stack(got.step_logits), want_rows, atol=1e-5)
    # a stop token ends the loop on the device after it is emitted
    stop = want[4]
    got = decode_tokens(model, params, logits, apply_policy(policy, dense, aux, 12),
                        policy=policy, start_pos=len(prompt), max_new_tokens=12,
                        sampling=sampling, stop_ids=[stop])
    assert got.tokens == want[:want.index(stop) + 1] and got.stopped


def test_the_layer_loop_equals_the_layers_one_after_another(tiny):
    """A LayerStack cache runs the decode step as one scan over the stacked layers: the same
    logits as a tuple cache (layers unrolled); the prefill scans either way."""
    model, params = tiny
    prompt = list(np.random.RandomState(1).randint(0, 256, 100))
    for name in ("full", "mpcache", "snapkv"):
        policy = make_policy(name, 0.3)
        runs = []
        for stacked in (False, True):
            cache = model.init_cache(len(prompt) + 6, stacked=stacked)
            logits, dense, aux = model.prefill(params, prompt, cache,
                                               return_queries=policy.needs_queries)
            assert isinstance(dense, LayerStack) == stacked
            cache = apply_policy(policy, dense, aux, 6)
            assert isinstance(cache, LayerStack) == stacked
            rows = [np.asarray(logits)]
            for step, token in enumerate(prompt[:5]):
                logits, cache = model.decode_step(params, token, len(prompt) + step, cache,
                                                  policy)
                rows.append(np.asarray(logits))
            runs.append(np.stack(rows))
        np.testing.assert_allclose(runs[0], runs[1], atol=1e-5)
    stacked = transformer.stack_layers(params)
    assert stacked["layers"]["q_proj"]["kernel"].shape[0] == model.cfg.num_layers
    back = transformer.unstack_layers(stacked)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_batch_decodes_as_its_samples_one_by_one(tiny):
    """Three bucketed prompts of different lengths decoded together (and teacher-forced
    together) give each sample's own tokens and logits."""
    model, params = tiny
    rng = np.random.RandomState(2)
    policy = make_policy("mpcache", 0.4)
    steps = 8
    prompts, outs, cache = _bucketed_batch(model, params, policy, rng, (98, 101, 128),
                                           (97, 128), steps)
    logits = jnp.stack([o[0] for o in outs])
    start = jnp.asarray([len(p) for p in prompts], jnp.int32)
    stop = jnp.zeros((0,), jnp.int32)
    forced = jnp.asarray(rng.randint(0, 256, (3, steps)), jnp.int32)
    copy = jax.tree_util.tree_map(jnp.copy, cache)
    tokens, counts, _, rows, _ = decode_loop_batch(model, policy, params, logits, cache, start,
                                                   stop, steps=steps, keep_logits=True)
    _, _, _, forced_rows, _ = decode_loop_batch(model, policy, params, logits, copy, start,
                                                stop, forced, steps=steps, keep_logits=True)
    for i, (prompt, (first, dense, aux)) in enumerate(zip(prompts, outs)):
        single = apply_policy(policy, dense, aux, steps)
        want, want_rows = _host_loop(model, params, first, single, policy, len(prompt), steps,
                                     SamplingConfig())
        assert [int(t) for t in np.asarray(tokens[i, :counts[i]])] == want
        np.testing.assert_allclose(np.asarray(rows[i]), want_rows, atol=1e-5)
        _, want_forced, _ = _fed_then_greedy(model, params, first,
                                             apply_policy(policy, dense, aux, steps), policy,
                                             len(prompt), np.asarray(forced[i]), steps, steps)
        np.testing.assert_allclose(np.asarray(forced_rows[i]), want_forced, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(take_sample(stack_samples([o[2] for o in outs]),
                                                         1).length), 101)


def test_one_batch_mixes_forced_steps_limits_and_stops(tiny):
    """Per sample, n_forced leading tokens fed, then greedy; its own limit of steps; a stop
    token only ends a free step: each sample as the host loop gives it alone, -1 and zero rows
    past its end, in one program for all three settings."""
    model, params = tiny
    rng = np.random.RandomState(5)
    policy = make_policy("mpcache", 0.4)
    steps = 8
    prompts, outs, cache = _bucketed_batch(model, params, policy, rng, (110, 120, 128),
                                           (97, 128), steps)
    free_tokens, _ = _host_loop(model, params, outs[2][0],
                                apply_policy(policy, outs[2][1], outs[2][2], steps), policy,
                                len(prompts[2]), steps, SamplingConfig())
    # sample 2 stops at the last token that its free run has not produced before
    firsts = [t for j, t in enumerate(free_tokens[:-1]) if j and free_tokens.index(t) == j]
    stop = jnp.asarray([firsts[-1]], jnp.int32)
    forced = jnp.asarray(rng.randint(0, 256, (3, steps)), jnp.int32)
    n_forced = jnp.asarray([3, steps, 0], jnp.int32)
    limit = jnp.asarray([6, 4, steps], jnp.int32)
    start = jnp.asarray([len(p) for p in prompts], jnp.int32)
    tokens, counts, stopped, rows, _ = decode_loop_batch(
        model, policy, params, jnp.stack([o[0] for o in outs]), cache, start, stop, forced,
        n_forced, limit, steps=steps, keep_logits=True)
    ends = []
    for i, (prompt, (logits, dense, aux)) in enumerate(zip(prompts, outs)):
        want, want_rows, hit_stop = _fed_then_greedy(
            model, params, logits, apply_policy(policy, dense, aux, steps), policy, len(prompt),
            np.asarray(forced[i]), int(n_forced[i]), int(limit[i]), int(stop[0]))
        got = [int(t) for t in np.asarray(tokens[i])]
        assert got == want + [-1] * (steps - len(want)), i
        assert int(counts[i]) == len(want)
        np.testing.assert_allclose(np.asarray(rows[i, :len(want)]), want_rows, atol=1e-5)
        assert not np.asarray(rows[i, len(want):]).any()
        assert bool(stopped[i]) == hit_stop
        ends.append("stop" if hit_stop else len(want))
    assert ends[1] == 4 and ends[2] == "stop"           # the limit, and the stop token
    assert 1 < int(counts[2]) < steps and int(counts[1]) == 4


def test_the_batched_harness_gives_each_samples_records_alone():
    """experiments.fidelity.evaluate_batch on three samples of one bucket: the same records
    (outputs, agreement, KL) as each sample evaluated alone."""
    from experiments import fidelity, natural_tasks
    lm = registry.load("smollm2-135m", num_layers=2)
    samples = list(natural_tasks.NATURAL_TASKS["multi_needle"](
        lm.tokenizer, lengths=[300], depths=[0.3, 0.7], num_samples=3, seed=0))
    policies = [("full", 1.0, make_policy("full")), ("mpcache", 0.2, make_policy("mpcache", 0.2)),
                ("longcache", 0.2, make_policy("longcache", 0.2))]
    kwargs = dict(max_new_tokens=10, agree_tokens=6, with_mechanism=False, bucket=(257, 384))
    together = fidelity.evaluate_batch(lm, samples, policies, batch_size=4, **kwargs)
    for sample, records in zip(samples, together):
        alone = fidelity.evaluate_batch(lm, [sample], policies, **kwargs)[0]
        for a, b in zip(records, alone):
            assert (a["output"], a["agree"], a["agree_prefix"]) == \
                   (b["output"], b["agree"], b["agree_prefix"])
            assert abs(a["kl"] - b["kl"]) < 1e-5 and a["batch"] == 3 and b["batch"] == 1


def _run_python(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_plaintext_generation_and_an_accuracy_sample_never_import_spu():
    code = """
import sys, json
from models import registry
from runtime.generate import generate
from mpcache_jax.policies import make_policy
from experiments import fidelity, natural_tasks
lm = registry.load("llama-tiny")
generate(lm.model, lm.params, list(range(1, 60)), max_new_tokens=4,
         policy=make_policy("mpcache", 0.5))
lm = registry.load("smollm2-135m", num_layers=1)
sample = next(iter(natural_tasks.NATURAL_TASKS["multi_needle"](lm.tokenizer, lengths=[300], depths=[0.5],
                                                     num_samples=1, seed=0)))
fidelity.evaluate_batch(lm, [sample], [("mpcache", 0.3, make_policy("mpcache", 0.3))],
                        max_new_tokens=3, agree_tokens=2, with_mechanism=False)
print(json.dumps(sorted(m for m in sys.modules if m == "spu" or m.startswith("spu."))))
"""
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_a_second_process_reads_its_programs_from_the_compilation_cache(tmp_path):
    """runtime.compile_cache: the first process compiles a prefill and writes it under
    <cache_dir>/xla; a second one finds it there (JAX's cache-hit log line)."""
    code = f"""
import logging, jax, numpy as np
logging.basicConfig(level=logging.DEBUG)
from runtime import compile_cache
print("dir", compile_cache.enable({str(tmp_path)!r}))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from models import registry
lm = registry.load("llama-tiny")
lm.model.prefill(lm.params, list(range(1, 200)), lm.model.init_cache(210))
"""
    first = _run_python(code)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "xla").is_dir() and any((tmp_path / "xla").iterdir())
    second = _run_python(code)
    assert second.returncode == 0, second.stderr[-3000:]
    hit = "Persistent compilation cache hit for 'jit__prefill'"
    assert hit not in first.stderr and hit in second.stderr


def test_device_check_runs_only_the_phases_asked_for(tmp_path, capsys):
    """experiments.device_check: --phases picks timing rows and/or CPU comparisons; a bad
    value is a usage error naming the choices; without an accelerator the comparisons are
    skipped with the reason printed and an empty record file."""
    from experiments import device_check
    with pytest.raises(SystemExit) as err:
        device_check.main(["device_check", "--phases=timing", f"--out={tmp_path}"])
    assert err.value.code == 2
    assert "time,compare" in capsys.readouterr().err
    assert device_check.main(["device_check", "--phases=compare", "--models=llama-tiny",
                              "--lengths=64", f"--out={tmp_path}"]) == 0
    if jax.devices()[0].platform == "cpu":
        assert "no CPU comparison (no accelerator)" in capsys.readouterr().out
        assert (tmp_path / "device_check.jsonl").read_text() == ""


def test_device_check_perturb_compares_the_cpu_with_weights_moved_by_that_scale(tmp_path, capsys):
    """--perturb=EPS: the compare phase also runs (on a CPU alone) against the cut model with
    its weights times (1 + EPS x N(0, 1)); the record carries the perturbed differences, which
    shrink with EPS; EPS outside [0, 1) is a usage error."""
    import json
    import numpy as np
    from experiments import device_check
    params = {"a": {"kernel": np.linspace(1.0, 2.0, 4096, dtype=np.float32)}}
    moved = device_check.perturbed(params, 1e-3, seed=0)["a"]["kernel"]
    change = moved / params["a"]["kernel"] - 1
    assert moved.dtype == np.float32 and 0.8e-3 < np.std(change) < 1.2e-3
    assert np.array_equal(device_check.perturbed(params, 0.0, seed=0)["a"]["kernel"],
                          params["a"]["kernel"])
    with pytest.raises(SystemExit) as err:
        device_check.main(["device_check", "--perturb=1.5", f"--out={tmp_path}"])
    assert err.value.code == 2 and "--perturb=1.5" in capsys.readouterr().err
    diffs = []
    for eps in (1e-2, 1e-4):
        out = tmp_path / str(eps)
        assert device_check.main(["device_check", "--phases=compare", "--models=llama-tiny",
                                  "--lengths=64", "--policies=full", "--new_tokens=4",
                                  "--cpu_layers=1", f"--perturb={eps}", f"--out={out}"]) == 0
        (record,) = [json.loads(line) for line in
                     (out / "device_check.jsonl").read_text().splitlines()]
        assert record["perturb"] == eps and record["cpu_layers"] == 1
        assert "error" not in record, record
        if jax.devices()[0].platform == "cpu":
            assert "max_abs_logit_diff_decode" not in record   # no accelerator to compare
        diffs.append(record["max_abs_logit_diff_prefill_perturbed"])
        assert 0 < diffs[-1] < record["logit_scale"]
    assert diffs[1] < diffs[0] / 10
