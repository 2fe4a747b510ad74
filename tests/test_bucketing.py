"""Bucketed prompts: a prompt padded to its bucket, its length a runtime value, decodes exactly
as the unpadded prompt (every registered policy), and one bucket compiles once.

The registry is enumerated, so a new policy is covered as soon as it is registered.
"""
import numpy as np
import pytest

from runtime import generate
from runtime.generate import apply_policy, bucket_of, prefill_prompt
from mpcache_jax.policies import POLICY_NAMES, make_policy
from models import model as model_module
from models import registry

BUCKET = (97, 128)        # prompts of 97..128 tokens share one compilation (one layout class)
STEPS = 4


@pytest.fixture(scope="module")
def llama():
    lm = registry.load("llama-tiny")
    tokens = np.random.RandomState(1).randint(0, lm.model.cfg.vocab_size, size=140)
    return lm.model, lm.params, tokens


def _run(model, params, tokens, prompt_len, policy, bucket):
    """Prefill logits, then STEPS teacher-forced decode steps: logits [1 + STEPS, V]."""
    logits, dense, aux = prefill_prompt(model, params, tokens[:prompt_len], STEPS,
                                        policy.needs_queries, bucket=bucket)
    cache = apply_policy(policy, dense, aux, STEPS)
    rows = [np.asarray(logits)]
    for t in range(prompt_len, prompt_len + STEPS - 1):
        logits, cache = model.decode_step(params, tokens[t], t, cache, policy)
        rows.append(np.asarray(logits))
    return np.stack(rows)


def test_bucket_of_picks_the_first_edge_at_or_above():
    assert bucket_of(100, [512, 128, 64]) == (65, 128)
    assert bucket_of(100, [512, 128, 96]) == (97, 128)
    assert bucket_of(64, [64, 128]) == (1, 64)
    with pytest.raises(ValueError, match="larger bucket"):
        bucket_of(200, [64, 128])


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "no_cache"])
def test_bucketed_prompt_decodes_like_the_unpadded_one(llama, name):
    model, params, tokens = llama
    policy = make_policy(name, 0.5)
    want = _run(model, params, tokens, 100, policy, None)
    got = _run(model, params, tokens, 100, policy, BUCKET)
    assert np.abs(got - want).max() <= 1e-5
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _compiled():
    return (model_module._prefill._cache_size(), model_module._decode._cache_size(),
            generate.compress_cache._cache_size())


@pytest.mark.parametrize("name", ["full", "mpcache", "snapkv", "h2o", "quest", "pqcache"])
def test_one_bucket_compiles_once(llama, name):
    model, params, tokens = llama
    policy = make_policy(name, 0.5)
    lengths = (98, 128, 111)
    want = [_run(model, params, tokens, n, policy, None) for n in lengths]
    _run(model, params, tokens, 105, policy, BUCKET)          # compiles the bucket's programs
    before = _compiled()
    for n, expected in zip(lengths, want):
        assert np.abs(_run(model, params, tokens, n, policy, BUCKET) - expected).max() <= 1e-5
    assert _compiled() == before


def test_bucketed_prefill_checks_the_length(llama):
    model, params, tokens = llama
    with pytest.raises(ValueError, match="outside its bucket"):
        prefill_prompt(model, params, tokens[:40], 2, bucket=BUCKET)


def test_bucketed_reuse_policy_decodes_like_the_unpadded_one(llama):
    """A working set refreshed every other step, on a bucketed prompt."""
    model, params, tokens = llama
    policy = make_policy("mpcache", 0.5, refresh_every=2)
    want = _run(model, params, tokens, 100, policy, None)
    got = _run(model, params, tokens, 100, policy, BUCKET)
    assert np.abs(got - want).max() <= 1e-5


# ----- the accuracy harness at the model's context ---------------------------------------------
def test_lengths_leave_room_for_new_tokens_and_beyond_the_context_are_refused():
    from experiments.accuracy import prompt_lengths
    assert prompt_lengths([4096, 8160, 8192], 24, 8192, "m") == [4096, 8160, 8168]
    assert prompt_lengths([512, 1024], 24, 8192, "m") == [512, 1024]
    with pytest.raises(ValueError, match="--lengths=1024,9000: 9000 exceeds m's context of 8192"):
        prompt_lengths([1024, 9000], 24, 8192, "m")
    with pytest.raises(ValueError, match="leave no room"):
        prompt_lengths([512], 600, 512, "m")
    assert prompt_lengths([2048, 8192], 24, 32768, "m", [2048, 8192]) == [2048, 8192]
    with pytest.raises(ValueError, match=r"--lengths=2048,16384: 16384 is longer than the "
                                         r"largest of --buckets \(8192\); add an edge"):
        prompt_lengths([2048, 16384], 24, 32768, "m", [2048, 8192])


def _flags(**overrides):
    from experiments.accuracy import AccuracyConfig
    return AccuracyConfig(**{"buckets": (512, 1024, 4096, 8192), **overrides})


def test_a_bucket_never_leaves_less_room_than_the_new_tokens():
    from experiments.accuracy import sample_bucket
    from experiments.tasks import Sample
    sample = Sample("qa", "0", [1] * 4400, ["x"], "qa_f1")
    assert sample_bucket(sample, _flags(), 8192) == (4097, 8168)
    assert sample_bucket(sample, _flags(), 16384) == (4097, 8192)
    ppl = Sample("continuation", "1", [1] * 600, [], "ppl", target_ids=[2] * 64)
    assert sample_bucket(ppl, _flags(), 1000) == (513, 936)
    assert sample_bucket(sample, _flags(buckets=()), 8192) is None


def test_a_sample_that_does_not_fit_is_skipped_and_counted(llama):
    """A prompt whose new tokens would run past the context is recorded as skipped (one record
    per policy, with the reason) and the run goes on."""
    from experiments.accuracy import evaluate_batch
    from experiments.tasks import Sample
    from models.catalog import LoadedModel
    model, params, _ = llama
    loaded = LoadedModel(model, params)
    context = model.cfg.max_position
    sample = Sample("qa", "7", [1] * (context - 10), ["x"], "qa_f1")
    policies = [("full", None, make_policy("full")), ("mpcache", 0.1, make_policy("mpcache", 0.1))]
    records = evaluate_batch(loaded, [sample], policies, _flags(), 1)[0]
    assert [r["policy"] for r in records] == ["full", "mpcache"]
    assert all(f"exceed the model's context of {context}" in r["skipped"] for r in records)


def test_the_default_buckets_serve_the_default_policy_from_the_first_edge_up():
    """Every default bucket above the first edge lies within one length class, so the default
    policy (which lays out prompts by that class) runs every prompt of the suite's lengths
    (a 1024-token prompt in [513, 1024] was skipped: the bucket spans 768 and 1024)."""
    from experiments import flags_def
    from mpcache_jax.policies.working_set import geometry_length
    edges = [int(e) for e in flags_def.FLAGS["buckets"].default]
    assert edges == sorted(edges) and {768, 1024, 2048, 8192, 32768} <= set(edges)
    policy = make_policy("mpcache", 0.1)
    for low, high in zip(edges, edges[1:]):
        assert geometry_length(low + 1) == geometry_length(high), (low, high)
        policy.check_bucketed(high, low + 1, high)
