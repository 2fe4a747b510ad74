"""Secure inference through SPU (runtime/mpc): configs, cost parsing, secure decode vs
plaintext, and the no-reveal property of the compiled programs. Tiny models, seconds each."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime import mpc
from runtime.generate import apply_policy
from mpcache_jax.policies import make_policy
from models import registry
from models.transformer import activation_fn, rms_norm

# Secure logits vs plaintext logits (FM64, 18 fraction bits: resolution 4e-6; exp, reciprocal
# and rsqrt are iterative fixed-point approximations): max |delta logit| allowed.
LOGIT_TOL = 2e-2
PROMPT_LEN = 64


# ----- runtime configs ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"protocol": "SPDZ"}, "protocol='SPDZ' is unknown"),
    ({"protocol": "ABY3", "parties": 2}, "ABY3 runs with 3 parties, got 2"),
    ({"protocol": "CHEETAH", "parties": 3}, "CHEETAH runs with 2 parties, got 3"),
    ({"field": "FM32", "fraction_bits": 18}, "field FM32 (32 bits) is too small for 18 fraction"),
    ({"field": "FM16"}, "field='FM16' is unknown"),
    ({"exp_mode": "cubic"}, "exp_mode='cubic' is unknown"),
])
def test_bad_runtime_configs_say_what_to_change(kwargs, message):
    with pytest.raises(mpc.MPCConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mpc.MPCConfig(**kwargs)


def test_runtime_config_from_json_and_defaults():
    cfg = mpc.from_json('{"protocol": "SEMI2K", "field": "FM64", "fxp_fraction_bits": 16, '
                        '"fxp_exp_mode": "EXP_PADE"}')
    assert (cfg.protocol, cfg.parties, cfg.fraction_bits, cfg.exp_mode) == (
        "SEMI2K", 2, 16, "EXP_PADE")
    assert mpc.MPCConfig(protocol="aby3").parties == 3
    assert mpc.MPCConfig(field="FM128").fraction_bits == 26
    rt = cfg.runtime_config()
    assert rt.fxp_fraction_bits == 16
    wrapped = {"runtime_config": {"protocol": "ABY3"}, "parties": ["a:1", "b:2", "c:3"]}
    assert mpc.from_json(wrapped).addresses == ("a:1", "b:2", "c:3")
    with pytest.raises(mpc.MPCConfigError, match="ABY3 runs with 3 parties, got 2"):
        mpc.from_json({"runtime_config": {"protocol": "ABY3"}, "parties": ["a:1", "b:2"]})
    with pytest.raises(mpc.MPCConfigError, match="not part of SPU"):
        mpc.from_json('{"protocol": "ABY3", "fxp_fraction_bitz": 18}')
    with pytest.raises(mpc.MPCConfigError, match="not valid JSON"):
        mpc.from_json("{protocol: ABY3")


# ----- cost accounting -------------------------------------------------------------------------
LOG = """\
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:172] [Profiling] SPU execution step completed, input processing took 1e-06s, execution took 0.5s, output processing took 1e-06s, total time 0.5s.
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:220] HLO profiling: total time 0.4
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:223] - pphlo.dot, executed 3 times, duration 0.25s, send bytes 1000 recv bytes 900, send actions 3, recv actions 3
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:223] - pphlo.exponential, executed 1 times, duration 0.1s, send bytes 400 recv bytes 400, send actions 20, recv actions 20
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:223] - pphlo.custom_call: mhlo.topk, executed 2 times, duration 0.05s, send bytes 100 recv bytes 50, send actions 7, recv actions 5
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:220] HAL profiling: total time 0.4
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:223] - f_mmul, executed 3 times, duration 0.25s, send bytes 1000 recv bytes 900, send actions 3, recv actions 3
2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:233] Link details: total send bytes 1500, recv bytes 1350, send actions 30, recv actions 28
"""


def test_profile_log_parser_and_network_model():
    (run,) = mpc.parse_profile_log("noise before the run\n" + LOG)
    assert (run.name, run.exec_s) == ("step", 0.5)
    assert run.ops["HLO"]["pphlo.dot"].count == 3
    assert run.ops["HLO"]["pphlo.custom_call: mhlo.topk"].send_bytes == 100
    assert (run.send_bytes, run.recv_bytes, run.send_actions) == (1500, 1350, 30)
    phases = mpc.phase_breakdown(run)   # bytes sent (one party's profile here)
    assert phases["matmul"]["comm_bytes"] == 1000 and phases["exp"]["messages"] == 20
    assert phases["compare"]["comm_bytes"] == 100
    # 377 MB over a 377 MB/s link is 1 s; 10 messages x 0.3 ms RTT; plus compute.
    assert mpc.LAN.latency(377_000_000, 10, compute_s=0.5) == pytest.approx(1.503)
    # One party's profile is not a run's cost (no estimate x parties): see test_mpc_accounting.
    with pytest.raises(ValueError, match="needs every party's profile"):
        mpc.cost_fields(run, wall_s=0.7, parties=3)


# ----- numerics options ----------------------------------------------------------------------------
@pytest.mark.parametrize("name, bound", [("silu", 0.011), ("gelu", 0.005), ("gelu_tanh", 0.005)])
def test_poly_activations_stay_close_to_exact(name, bound):
    x = jnp.linspace(-40.0, 40.0, 80001)
    err = jnp.abs(activation_fn(name, "poly")(x) - activation_fn(name)(x))
    assert float(jnp.max(err)) <= bound
    # Far tails are exact: 0 on the left, the identity on the right.
    assert float(activation_fn(name, "poly")(jnp.float32(-30.0))) == 0.0
    assert float(activation_fn(name, "poly")(jnp.float32(30.0))) == 30.0


@pytest.mark.parametrize("name", ["silu", "gelu_tanh"])
def test_newton_activations_match_exact_in_float(name):
    x = jnp.linspace(-60.0, 60.0, 120001)
    err = jnp.abs(activation_fn(name, "newton")(x) - activation_fn(name)(x))
    assert float(jnp.max(err)) <= 2e-5
    with pytest.raises(ValueError, match="erf GeLU"):
        activation_fn("gelu", "newton")


def test_newton_silu_under_aby3_matches_exact_silu():
    x = (np.random.RandomState(0).randn(64) * 4).astype(np.float32)
    x[:6] = [-30.0, -8.0, -1e-3, 0.0, 8.0, 30.0]
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"))
    prog = backend.compile(activation_fn("silu", "newton"), (x,), mpc.SECRET)
    out, _, _ = backend.run(prog, backend.share(x, mpc.SECRET))
    np.testing.assert_allclose(np.asarray(backend.reveal(out)), np.asarray(jax.nn.silu(x)),
                               atol=5e-3)


def test_a_handle_collected_on_a_party_thread_is_freed_without_a_stall():
    """A shared value's finalizer runs wherever the garbage collector does, here on a party's
    own thread in the middle of a call: that call still ends, and the value is deleted from
    every runtime by the next call (a finalizer that called the parties itself waited
    forever for its own thread, as a reused simulator did in a test's second share)."""
    import threading
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"), profile=False)
    x = np.arange(6, dtype=np.float32)
    box = [backend.share(x, mpc.SECRET)]
    name = box[0].name

    def job(rank, rt):
        if rank == 0:
            box.clear()        # the last reference dropped, so finalized, on party 0's thread
        return rt.get_var(name) is not None

    results = []
    caller = threading.Thread(target=lambda: results.append(backend.parties.call(job)),
                              daemon=True)
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), "a finalizer on a party's thread stalled the call"
    assert results == [[True, True, True]] and not box

    def has(rank, rt):
        try:
            rt.get_var(name)
            return True
        except Exception:
            return False
    assert backend.parties.call(has) == [False, False, False]      # deleted before this job
    y = backend.share(x, mpc.SECRET)                       # the parties still serve
    np.testing.assert_array_equal(np.asarray(backend.reveal(y)), x)


def test_poly_activation_model_runs_jitted_and_stays_close(tiny):
    from models.model import Model
    model, params, prompt = tiny
    exact = np.asarray(model.forward(params, prompt[:16]))
    poly = np.asarray(Model(model.cfg.replace(activation_impl="poly")).forward(params, prompt[:16]))
    assert 0 < np.max(np.abs(poly - exact)) < 0.05


def test_default_activation_is_the_exact_one():
    assert registry.get_config("llama-tiny").activation_impl == "exact"
    x = jnp.linspace(-5, 5, 11)
    np.testing.assert_array_equal(activation_fn("silu")(x), jax.nn.silu(x))


# ----- secure decode == plaintext ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    loaded = registry.load("llama-tiny", num_layers=2, seed=1)
    # Larger weights than the init's 0.02 so that logits are spread and the greedy choice has a
    # clear margin (random tiny models otherwise put every logit within 1e-3).
    params = jax.tree_util.tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, loaded.params)
    prompt = list(np.random.RandomState(0).randint(0, 256, PROMPT_LEN))
    return loaded.model, params, prompt


def tiny_policy(name):
    if name == "mpcache":          # the default at 16 of 32 tokens: 2 stripes of clusters of 4,
        # its schedule shortened to fit a few steps (the first 2 select, then every 3rd)
        return make_policy("mpcache", budget=16, cluster_size=4, stripes=2, recent_min=4,
                           dense_steps=2, refresh_every=3)
    if name == "mpcache_exact":
        return make_policy("mpcache_exact", budget=16, levels=((8, 0.5), (4, None)),
                           static_keep=32, share_from=0, topk_method="rank")
    if name == "mpcache_reuse":   # the exact selection's working set, gathered every other step
        return make_policy("mpcache_exact", budget=16, levels=((8, 0.5), (4, None)),
                           share_from=0, topk_method="rank", refresh_every=2)
    return make_policy(name)


def secure_vs_plain_decode(model, params, prompt, policy, protocol):
    T = len(prompt)
    logits, dense, aux = model.prefill(params, prompt, model.init_cache(T + 4),
                                       return_queries=True)
    token = int(np.argmax(logits))
    out = {}
    for backend_name in ("xla", "spu_sim"):
        backend = mpc.make_backend(backend_name, mpc.MPCConfig(protocol=protocol))
        session = mpc.SecureSession(backend, model, params, policy)
        _, decode, cache_vis = session.compile(session.programs(T, 4))
        shared = backend.share(apply_policy(policy, dense, aux, 4), cache_vis)
        tok, logits_sh, _, cost, _ = session.decode(decode, token, T, shared)
        out[backend_name] = (tok, np.asarray(backend.reveal(logits_sh)), cost)
    return out


@pytest.mark.parametrize("protocol", ["ABY3", "SEMI2K"])
@pytest.mark.parametrize("policy_name", ["full", "mpcache", "mpcache_exact"])
def test_secure_decode_matches_plaintext(tiny, policy_name, protocol):
    model, params, prompt = tiny
    out = secure_vs_plain_decode(model, params, prompt, tiny_policy(policy_name), protocol)
    (tok_p, logits_p, _), (tok_s, logits_s, cost) = out["xla"], out["spu_sim"]
    top2 = np.sort(logits_p)[-2:]
    assert top2[1] - top2[0] > 2 * LOGIT_TOL, "greedy margin too small for the check"
    assert np.max(np.abs(logits_s - logits_p)) <= LOGIT_TOL
    assert tok_s == tok_p
    assert cost.send_bytes > 0 and cost.send_actions > 0


@pytest.mark.slow
def test_secure_decode_matches_plaintext_cheetah(tiny):
    model, params, prompt = tiny
    out = secure_vs_plain_decode(model, params, prompt[:32], tiny_policy("mpcache"), "CHEETAH")
    assert np.max(np.abs(out["spu_sim"][1] - out["xla"][1])) <= LOGIT_TOL
    assert out["spu_sim"][0] == out["xla"][0]


def test_secure_generation_prefill_eviction_and_decode_inside_mpc(tiny):
    """Prefill, static eviction (compress) and decode steps all run under ABY3 and produce the
    plaintext tokens; the cache stays shared between steps."""
    model, params, prompt = tiny
    policy = tiny_policy("mpcache_exact")
    runs = {}
    for backend_name in ("xla", "spu_sim"):
        backend = mpc.make_backend(backend_name, mpc.MPCConfig(protocol="ABY3"))
        runs[backend_name] = mpc.SecureSession(backend, model, params, policy).generate(
            prompt[:32], max_new_tokens=3)
    assert runs["spu_sim"].tokens == runs["xla"].tokens
    assert [s.phase for s in runs["spu_sim"].steps] == ["prefill", "decode", "decode"]
    prefill, decode = runs["spu_sim"].steps[0].cost, runs["spu_sim"].steps[1].cost
    assert prefill.send_bytes > decode.send_bytes > 0


@pytest.mark.parametrize("policy_name", ["mpcache", "mpcache_reuse"])
def test_secure_reuse_generation_equals_plaintext_and_pays_on_refresh_steps(tiny, policy_name):
    """A working set refreshed on a public schedule (the default's: its first steps, then
    every few; the exact selection's: every other step):
    SPU runs one branch of the public refresh condition per step (the selection and gather
    only on refresh steps) and gives the plaintext tokens."""
    model, params, prompt = tiny
    policy = tiny_policy(policy_name)
    runs = {}
    for backend_name in ("xla", "spu_sim"):
        backend = mpc.make_backend(backend_name, mpc.MPCConfig(protocol="ABY3"))
        runs[backend_name] = mpc.SecureSession(backend, model, params, policy).generate(
            prompt, max_new_tokens=6, prefill="clear")
    assert runs["spu_sim"].tokens == runs["xla"].tokens
    steps = [s.cost for s in runs["spu_sim"].steps if s.phase == "decode"]
    dense = policy.dense_steps if policy_name == "mpcache" else 0
    due = [i < dense or i % policy.refresh_every == 0 for i in range(len(steps))]
    refresh = [s for s, d in zip(steps, due) if d]
    reuse = [s for s, d in zip(steps, due) if not d]
    assert len(refresh) >= 2 and len(reuse) >= 2
    assert min(s.send_bytes for s in refresh) > max(s.send_bytes for s in reuse) > 0
    assert min(s.send_actions for s in refresh) > max(s.send_actions for s in reuse)


def test_clear_prefill_shares_the_plaintext_prefill_and_decodes_the_same(tiny, monkeypatch):
    """prefill="clear" (decode benchmarks): the tokens of the secure prefill's run, decode
    steps of the same cost, the prefill recorded without an MPC cost, its plaintext program
    traced once per shape; without the prompt on a party it is refused."""
    from runtime import programs
    traces = []
    dense_prefill = programs.dense_prefill
    monkeypatch.setattr(programs, "dense_prefill",
                        lambda *args: traces.append(1) or dense_prefill(*args))
    model, params, prompt = tiny
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"))
    session = mpc.SecureSession(backend, model, params, tiny_policy("mpcache"))
    secure = session.generate(prompt[:32], max_new_tokens=3)
    clear = session.generate(prompt[:32], max_new_tokens=3, prefill="clear")
    assert clear.tokens == secure.tokens
    traced = len(traces)
    assert session.generate(prompt[:32], max_new_tokens=3, prefill="clear").tokens == clear.tokens
    assert len(traces) == traced > 0
    assert [s.phase for s in clear.steps] == ["prefill_clear", "decode", "decode"]
    assert clear.steps[0].cost is None
    for a, b in zip(secure.steps[1:], clear.steps[1:]):
        assert a.cost.send_bytes == b.cost.send_bytes > 0
        assert a.cost.send_actions == b.cost.send_actions
    with pytest.raises(ValueError, match="needs the public prompt_ids"):
        session.generate(None, max_new_tokens=2, prompt_len=32, prefill="clear")
    with pytest.raises(ValueError, match="prefill='plain'"):
        session.generate(prompt[:32], max_new_tokens=2, prefill="plain")


# ----- nothing secret is revealed inside the programs ---------------------------------------------------
@pytest.mark.parametrize("policy_name", ["mpcache", "mpcache_exact", "mpcache_reuse"])
def test_compiled_programs_reveal_nothing_and_positions_are_public(tiny, policy_name):
    model, params, prompt = tiny
    policy = tiny_policy(policy_name)
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"), profile=False)
    session = mpc.SecureSession(backend, model, params, policy)
    progs = session.programs(32, 4)
    prefill, decode, _ = session.compile(progs)
    ps = session._params_shape
    for program, fn, args in ((prefill, progs.prefill, progs.prefill_args(ps)),
                              (decode, progs.decode, progs.decode_args(ps))):
        assert mpc.secret_reveals(program.ir) == []
        outs = jax.tree_util.tree_unflatten(program.out_tree, program.out_visibility)
        assert outs[0] == mpc.SECRET and outs[1] == mpc.SECRET   # sampled token, logits
        # Every public output depends on public inputs only (positions, counters, zeros).
        in_vis = jax.tree_util.tree_unflatten(program.in_tree, program.visibility)
        by_dependency = jax.tree_util.tree_leaves(mpc.dependency_visibility(fn, args, in_vis))
        for spu_vis, dep_vis in zip(program.out_visibility, by_dependency):
            assert spu_vis == mpc.SECRET or dep_vis == mpc.PUBLIC
        # Kept keys/values and cluster digests (derived from the prompt) stay secret, and so
        # does a working set once a decode step has gathered it (prefill leaves it empty).
        for path, vis in jax.tree_util.tree_flatten_with_path(outs[2])[0]:
            name = jax.tree_util.keystr(path)
            gathered = ".working" in name and program is decode
            if (name.endswith((".k", ".v")) and ".new." not in name and ".working" not in name
                    or ".extras" in name or gathered):
                assert vis == mpc.SECRET, name
    # The decode position is a public input: a plain i32 argument in the compiled signature.
    n_params = len(jax.tree_util.tree_leaves(ps))
    assert decode.visibility[n_params + 1] == mpc.PUBLIC
    signature = next(line for line in decode.ir.splitlines() if "func.func @main" in line)
    assert f"%arg{n_params + 1}: tensor<i32>" in signature


def test_reveal_check_catches_a_mid_program_reveal():
    from spu.experimental import reveal
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"), profile=False)

    def leaky(x, w):
        scores = x @ w
        return jnp.argmax(reveal(scores))  # reveals every score, not just the chosen token

    def honest(x, w):
        return jnp.argmax(x @ w)
    x, w = np.ones(4, np.float32), np.ones((4, 8), np.float32)
    assert mpc.secret_reveals(backend.compile(leaky, (x, w), mpc.SECRET,
                                              allow_reveals=True).ir)
    assert mpc.secret_reveals(backend.compile(honest, (x, w), mpc.SECRET).ir) == []
    # Every backend compile (the CLI's programs included) refuses the leaky program.
    with pytest.raises(ValueError, match="reveals a secret before its outputs"):
        backend.compile(leaky, (x, w), mpc.SECRET)


def test_reveal_check_follows_region_scopes():
    """The branches of a public-predicate `lax.cond` number their values anew (and the program
    reuses the numbers after them): a public value named like a secret one of a branch is no
    reveal, and a reveal inside a branch is still caught."""
    from spu.experimental import reveal
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"), profile=False)

    def program(leak):
        def fn(x, n):
            heavy = lambda x: jnp.exp((reveal(x) if leak else x) @ x.T).sum(0)
            light = lambda x: x[:, 0] * 2.0
            y = jax.lax.cond(n % 2 == 0, heavy, light, x)
            return y * jnp.arange(8, dtype=jnp.float32)      # public iota after the branches
        return backend.compile(fn, (np.ones((8, 8), np.float32), np.int32(0)),
                               (mpc.SECRET, mpc.PUBLIC), allow_reveals=leak)
    assert mpc.secret_reveals(program(False).ir) == []
    assert mpc.secret_reveals(program(True).ir)


def test_reveal_check_follows_while_loops():
    """A `lax.map` over public starts compiles to a while whose public counter is carried
    beside secret values: no reveal. Its body sees the carried values with their visibility,
    so a secret made public inside the body, or a secret initial value carried as public,
    is caught."""
    from spu.experimental import reveal
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"), profile=False)

    def program(leak):
        def fn(x):
            def one(s):
                block = jax.lax.dynamic_slice_in_dim(x, s, 2, axis=0)
                return jnp.exp(reveal(block) if leak else block)
            return jax.lax.map(one, jnp.asarray([0, 2, 4], jnp.int32))
        return backend.compile(fn, (np.ones(6, np.float32),), mpc.SECRET, allow_reveals=leak)
    honest = program(False).ir
    assert "pphlo.while(" in honest and mpc.secret_reveals(honest) == []
    assert mpc.secret_reveals(program(True).ir)
    # The same loop, hand-edited: the body turns the carried secret public (no reveal call),
    # or the loop carries a secret initial value in a public position.
    body_leak = honest.replace("%29 = pphlo.exponential %28 : tensor<2x!pphlo.secret<f32>>",
                               "%29 = pphlo.convert %28 : (tensor<2x!pphlo.secret<f32>>) -> "
                               "tensor<2xf32>")
    line = next(l for l in honest.splitlines() if "pphlo.while(" in l)
    carried_public = honest.replace(line, line.replace("tensor<3x2x!pphlo.secret<f32>>",
                                                       "tensor<3x2xf32>"))
    for leaky in (body_leak, carried_public):
        assert leaky != honest and mpc.secret_reveals(leaky)
    # A carried secret (region argument %arg2) made public in the body.
    ir = """  func.func @main(%arg0: tensor<2x!pphlo.secret<f32>>) -> tensor<2x!pphlo.secret<f32>> {
    %0 = pphlo.constant dense<0> : tensor<i32>
    %1:2 = pphlo.while(%arg1 = %0, %arg2 = %arg0) : tensor<i32>, tensor<2x!pphlo.secret<f32>>
     cond {
      %2 = pphlo.less %arg1, %0 : (tensor<i32>, tensor<i32>) -> tensor<i1>
      pphlo.return %2 : tensor<i1>
    } do {
      %2 = pphlo.convert %arg2 : (tensor<2x!pphlo.secret<f32>>) -> tensor<2xf32>
      %3 = pphlo.convert %2 : (tensor<2xf32>) -> tensor<2x!pphlo.secret<f32>>
      pphlo.return %arg1, %3 : tensor<i32>, tensor<2x!pphlo.secret<f32>>
    }
    return %1#1 : tensor<2x!pphlo.secret<f32>>
  }"""
    assert [line.split(" = ")[0] for line in mpc.secret_reveals(ir)] == ["%2"]
    # Each result of a multi-result op has its own visibility: the loop's public counter
    # (result #0) read after the loop is no reveal; its secret value (result #1) made public is.
    after = """    %4 = pphlo.slice %1#{i} [0:1:1] : (tensor<{t}>) -> tensor<1xi32>
    return %1#1 : tensor<2x!pphlo.secret<f32>>"""
    clean = ir.replace("%2 = pphlo.convert %arg2 : (tensor<2x!pphlo.secret<f32>>) -> tensor<2xf32>\n"
                       "      %3 = pphlo.convert %2 : (tensor<2xf32>) -> tensor<2x!pphlo.secret<f32>>",
                       "%3 = pphlo.negate %arg2 : tensor<2x!pphlo.secret<f32>>")
    assert mpc.secret_reveals(clean) == []
    ret = "    return %1#1 : tensor<2x!pphlo.secret<f32>>"
    public_read = clean.replace(ret, after.format(i=0, t="i32"))
    secret_read = clean.replace(ret, after.format(i=1, t="2x!pphlo.secret<f32>"))
    assert public_read != clean and mpc.secret_reveals(public_read) == []
    assert [line.split(" = ")[0] for line in mpc.secret_reveals(secret_read)] == ["%4"]


def _spu_apply(fn, *args, config=None):
    backend = mpc.make_backend("spu_sim", config or mpc.MPCConfig(protocol="ABY3"), profile=False)
    program = backend.compile(fn, args, tuple(mpc.SECRET for _ in args))
    out, _, _ = backend.run(program, *(backend.share(a, mpc.SECRET) for a in args))
    return np.asarray(backend.reveal(out))


def test_rmsnorm_of_an_attention_sink_row_stays_in_fixed_point_range():
    # SmolLM2-135M's attention-sink row carries ~2.5e4 in one dimension (mean square ~1.1e6):
    # under FM64 / 18 fraction bits, x * x overflows and rsqrt(1.1e6) returns 0. Normalised,
    # that dimension is 25000 / sqrt(25000^2 / 576) = sqrt(576) = 24 (the rest is ~0).
    D = 576
    sink = np.zeros(D, np.float32)
    sink[507] = 25000.0
    typical = np.linspace(-3.0, 3.0, D, dtype=np.float32)  # mean square ~3: full precision
    small = np.full(D, 0.05, np.float32)                    # embedding-sized row -> all ones
    x = np.stack([sink, typical, small])
    params = {"scale": np.ones(D, np.float32)}

    secure = _spu_apply(lambda p, x: rms_norm(p, x, 1e-5), params, x)
    assert secure[0, 507] == pytest.approx(24.0, rel=1e-2)
    assert np.max(np.abs(np.delete(secure[0], 507))) < 1e-2
    np.testing.assert_allclose(secure[1], typical / np.sqrt(np.mean(typical ** 2)), atol=1e-2)
    np.testing.assert_allclose(secure[2], np.ones(D), atol=1e-2)

    # The textbook formula collapses the sink row under the same runtime config.
    naive = _spu_apply(lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5), x)
    assert abs(naive[0, 507] - 24.0) > 1.0


def test_windowed_prefill_attention_loops_over_its_full_blocks_on_xla_and_spu():
    """With a sliding window, the full blocks whose window lies inside the prompt run as one
    loop body (one copy in the program, not one per block) and give each row the softmax over
    its window, on XLA and under SPU."""
    from mpcache_jax import attention
    rng = np.random.default_rng(1)
    H, Hkv, T, d, block, window = 4, 2, 29, 8, 4, 8     # blocks at 8..24 share one shape
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((H, T, d), (Hkv, T, d), (Hkv, T, d)))
    ref = np.zeros((H, T, d), np.float32)
    for h in range(H):
        kv = h // (H // Hkv)
        for t in range(T):
            lo = max(0, t - window + 1)
            s = q[h, t] @ k[kv, lo:t + 1].T / np.sqrt(d)
            p = np.exp(s - s.max())
            ref[h, t] = (p / p.sum()) @ v[kv, lo:t + 1]
    fn = lambda q, k, v: attention.causal_attention(q, k, v, block=block, window=window)
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v)), ref, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(fn)(q, k, v))
    # blocks at 0 and 4 (window cut by the prompt start), the last (3 rows), one loop body
    assert jaxpr.count("scan[") == 1 and jaxpr.count("exp ") == 4
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"))
    program = backend.compile(fn, (q, k, v), (mpc.SECRET,) * 3)
    out, _, _ = backend.run(program, *(backend.share(a, mpc.SECRET) for a in (q, k, v)))
    np.testing.assert_allclose(np.asarray(backend.reveal(out)), ref, atol=2e-2)


def test_blocked_causal_attention_equals_one_block_and_costs_less_under_spu():
    from mpcache_jax import attention
    rng = np.random.default_rng(0)
    H, Hkv, T, d = 4, 2, 11, 8        # GQA, and T not a multiple of the block
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((H, T, d), (Hkv, T, d), (Hkv, T, d)))
    # Reference: softmax over each row's causal prefix, written out directly.
    ref = np.zeros((H, T, d), np.float32)
    for h in range(H):
        kv = h // (H // Hkv)
        for t in range(T):
            s = q[h, t] @ k[kv, :t + 1].T / np.sqrt(d)
            p = np.exp(s - s.max())
            ref[h, t] = (p / p.sum()) @ v[kv, :t + 1]
    one = np.asarray(attention.causal_attention(q, k, v, block=None))
    blocked = np.asarray(attention.causal_attention(q, k, v, block=4))
    np.testing.assert_allclose(one, ref, atol=1e-5)
    np.testing.assert_allclose(blocked, ref, atol=1e-5)

    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"))
    costs = {}
    for block in (None, 4):
        fn = lambda q, k, v, block=block: attention.causal_attention(q, k, v, block=block)
        program = backend.compile(fn, (q, k, v), (mpc.SECRET,) * 3)
        out, cost, _ = backend.run(program, *(backend.share(a, mpc.SECRET) for a in (q, k, v)))
        np.testing.assert_allclose(np.asarray(backend.reveal(out)), ref, atol=2e-2)
        costs[block] = cost
    # Blocks of 4 over 11 rows score 4*4 + 4*8 + 3*11 = 81 of 121 entries: the exp's bytes
    # (per score entry) drop by that share.
    exp_bytes = {b: c.ops["HLO"]["pphlo.exponential"].send_bytes for b, c in costs.items()}
    assert exp_bytes[4] == pytest.approx(exp_bytes[None] * 81 / 121, rel=0.02)
