"""The plaintext path on whatever accelerator JAX finds: prefill and the on-device decode loop
of `full` and the default policy at long prompts, timed, with the peak device memory and the
logits' largest difference from the same program on the CPU.

    mpcache device-check [--models=llama2-d1024,smollm2-135m,gemma3-270m]
        [--lengths=8192,32768] [--new_tokens=32] [--cpu_layers=2] [--host_loop]
        [--phases=time,compare] [--perturb=EPS] [--unbounded] [--out=DIR]

Weights: the registered model's real ones when its files are in the cache (no download is
attempted), else random weights of the real geometry (kernels N(0, 1/fan_in), so activations
and logits are O(1)); the context is stretched to the prompt where a geometry's is shorter
(RoPE takes any position; these rows measure speed and numerics, not answers). The CPU
comparison runs the same prompt through the model cut to its first --cpu_layers layers on the
accelerator and on the CPU (a whole 32768-token model on the CPU would take most of an hour):
prefill logits and every decode step's. Without an accelerator the CPU rows are printed and
the comparison is skipped (but for --perturb's). Writes DIR/device_check.jsonl (one record per
model, length and policy). --phases=compare runs only the comparisons. --host_loop also times
the per-token host loop (one `Model.decode_step` call and one read of the token per step)
beside the device loop. --perturb=EPS (the compare phase, also without an accelerator) runs the
cut model on the CPU a second time with its weights times (1 + EPS x N(0, 1)) and records how
far that moves the logits: a selection whose picks change under rounding-sized changes of the
weights moves its logits by far more than the weights' change, which tells such a difference
on the accelerator from a wrong program. --unbounded runs the programs as before the
long-prompt memory bounds (the prefill's blocks unrolled, not tiled; `compile-time
--unbounded`), for comparison. Uses no SPU: it runs on a current JAX (scripts/xla_env.sh).
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

from absl import flags

from experiments import cli
from experiments.compile_time import lifted_memory_bounds


def random_params(model, seed: int):
    """Weights of the model's geometry with O(1) activations, drawn on the host (numpy: no
    program to compile for the accelerator)."""
    import jax
    import numpy as np
    from models.model import tie_lm_head
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model.param_shapes())
    out = []
    for path, leaf in leaves:
        name = path[-1].key
        noise = rng.standard_normal(leaf.shape, np.float32)
        if name == "scale":
            out.append(1.0 + 0.1 * noise)
        elif name == "bias":
            out.append(0.05 * noise)
        elif name == "embedding":
            out.append(noise)
        else:
            out.append(noise / np.float32(leaf.shape[0] ** 0.5))
    params = jax.tree_util.tree_unflatten(treedef, out)
    return tie_lm_head(params) if model.cfg.tie_embeddings else params


def load(name: str, length: int, new_tokens: int, seed: int):
    """(model, params, weights) with a context of at least length + new_tokens."""
    from models import registry
    from models.model import Model
    cfg = registry.get_config(name)
    need = length + new_tokens
    real = registry.is_cached(name)
    if real:
        loaded = registry.load(name)
        model, params = loaded.model, loaded.params
    else:
        model = Model(cfg)
        params = random_params(model, seed)
    if model.cfg.max_position < need:
        model = Model(model.cfg.replace(max_position=need))
    return model, params, ("real" if real else "random")


def perturbed(params, scale: float, seed: int):
    """The weights times (1 + scale x N(0, 1)), drawn on the host."""
    import jax
    import numpy as np
    rng = np.random.default_rng(seed + 1)
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x) * (1 + scale * rng.standard_normal(np.shape(x))).astype(
            np.asarray(x).dtype), params)


def truncated(model, params, layers: int):
    """The model cut to its first `layers` layers (global ones kept: Gemma's sixth)."""
    from models.catalog import LoadedModel, pick_layers
    cfg = model.cfg
    keep = list(range(min(layers, cfg.num_layers)))
    if cfg.layer_types and all(cfg.local_layers[i] for i in keep):
        keep[-1] = cfg.local_layers.index(False)
    small = pick_layers(LoadedModel(model, params), keep)
    return small.model, small.params


def run_once(model, params, prompt, policy, new_tokens: int, device, repeats: int = 2):
    """Prefill + compress + the decode loop on `device` -> (prefill s, decode tokens/s,
    prefill logits, per-step logits, tokens); the last of `repeats` runs is timed (the
    first compiles)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from models import transformer
    from runtime.generate import apply_policy, decode_loop, prefill_prompt
    with jax.default_device(device):
        params = jax.device_put(transformer.stack_layers(params)
                                if transformer.scans_layers(model.cfg) else params, device)
        timings = []
        for _ in range(repeats):
            start = time.perf_counter()
            logits, dense, aux = prefill_prompt(model, params, prompt, new_tokens,
                                                policy.needs_queries)
            jax.block_until_ready(logits)
            prefill_s = time.perf_counter() - start
            cache = apply_policy(policy, dense, aux, new_tokens)
            del dense
            start = time.perf_counter()
            tokens, count, _, rows, _ = decode_loop(
                model, policy, params, logits, cache, jnp.asarray(len(prompt), jnp.int32),
                jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32), steps=new_tokens,
                keep_logits=True)
            jax.block_until_ready(rows)
            timings.append((prefill_s, new_tokens / (time.perf_counter() - start)))
        return (timings[-1][0], timings[-1][1], np.asarray(logits), np.asarray(rows),
                np.asarray(tokens)[:int(count)])


def host_loop_tokens_per_s(model, params, prompt, policy, new_tokens: int, device) -> float:
    """Greedy decoding with one `Model.decode_step` call and one host read of the token per
    step (the loop the device loop replaces), timed after a warm-up call."""
    import jax
    import numpy as np
    from runtime.generate import apply_policy, prefill_prompt
    with jax.default_device(device):
        params = jax.device_put(params, device)
        logits, dense, aux = prefill_prompt(model, params, prompt, new_tokens,
                                            policy.needs_queries)
        rates = []
        for _ in range(2):
            cache = apply_policy(policy, dense, aux, new_tokens)
            row = logits
            start = time.perf_counter()
            for step in range(new_tokens - 1):
                token = int(np.argmax(np.asarray(row)))
                row, cache = model.decode_step(params, token, len(prompt) + step, cache, policy)
            jax.block_until_ready(row)
            rates.append((new_tokens - 1) / (time.perf_counter() - start))
        return rates[-1]


def differences(got, want) -> dict:
    """Largest logit differences of two `run_once` results (prefill, any decode step) and
    whether their greedy tokens agree."""
    import numpy as np
    return {"max_abs_logit_diff_prefill": float(np.max(np.abs(got[2] - want[2]))),
            "max_abs_logit_diff_decode": float(np.max(np.abs(got[3] - want[3]))),
            "same_tokens": bool(np.array_equal(got[4], want[4]))}


def peak_bytes(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("models", "llama2-d1024,smollm2-135m,gemma3-270m",
                        "comma-separated registered models", flag_values=fv)
    flags.DEFINE_string("lengths", "8192,32768", "comma-separated prompt lengths in tokens",
                        flag_values=fv)
    flags.DEFINE_string("policies", "full,mpcache", "comma-separated registered policies",
                        flag_values=fv)
    flags.DEFINE_string("budget", "0.1min384", "the policies' budget: a share of the prompt, a "
                        "token count or RATIOminTOKENS (default: the shipped one)",
                        flag_values=fv)
    flags.DEFINE_integer("new_tokens", 32, "tokens decoded per row", flag_values=fv)
    flags.DEFINE_integer("cpu_layers", 2, "layers of the model cut for the CPU comparison "
                         "(0: none)", flag_values=fv)
    flags.DEFINE_bool("host_loop", False, "also time the per-token host loop "
                      "(Model.decode_step)", flag_values=fv)
    flags.DEFINE_string("phases", "time,compare", "time: the timing rows; compare: the CPU "
                        "comparisons", flag_values=fv)
    flags.DEFINE_float("perturb", 0.0, "compare phase: also compare the CPU run with one whose "
                       "weights are times (1 + PERTURB x N(0, 1)) (0: not)", flag_values=fv)
    flags.DEFINE_bool("unbounded", False, "lift the long-prompt memory bounds (the programs "
                      "before them, as compile-time --unbounded)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random weights' and prompts' seed", flag_values=fv)
    flags.DEFINE_string("out", "results/device_check", "output folder", flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    args = _flags()
    cli.parse(args, argv, __doc__)
    import jax
    import numpy as np
    from models.catalog import MODEL_NAMES
    from mpcache_jax.policies import POLICY_NAMES, make_policy
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown:
        cli.usage_error(f"--models: unknown {unknown}; registered: {', '.join(MODEL_NAMES)}")
    policies = [p for p in args.policies.split(",") if p]
    if [p for p in policies if p not in POLICY_NAMES]:
        cli.usage_error(f"--policies: registered ones are {', '.join(POLICY_NAMES)}")
    from mpcache_jax.primitives import budget_record, parse_budget
    try:
        budget = parse_budget(args.budget)
    except ValueError as err:
        cli.usage_error(f"--budget: {err}")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        cli.usage_error(f"--lengths={args.lengths!r}: comma-separated integers")
    phase_names = [p for p in args.phases.split(",") if p]
    if not phase_names or set(phase_names) - {"time", "compare"}:
        cli.usage_error(f"--phases={args.phases!r}: a comma-separated subset of time,compare")
    if args.new_tokens < 2:
        cli.usage_error("--new_tokens must be >= 2")
    if not 0 <= args.perturb < 1:
        cli.usage_error(f"--perturb={args.perturb}: a relative scale in [0, 1), e.g. 1e-3")
    device = jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    accelerated = device.platform != "cpu"
    compare = ((accelerated or args.perturb > 0) and args.cpu_layers > 0
               and "compare" in phase_names)
    if compare:
        what = (f"CPU comparison at {args.cpu_layers} layers"
                + ("" if accelerated else " (no accelerator: against perturbed weights only)"))
    else:
        what = "no CPU comparison ({})".format(
            "no accelerator" if not accelerated else "--cpu_layers=0" if not args.cpu_layers
            else "--phases")
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}); {what}",
          flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "device_check.jsonl"
    path.write_text("")        # one line per record as it is made: a cut-off run keeps its rows
    records = []
    rng = np.random.RandomState(args.seed)
    loaded = {}

    def setup(name, length):
        if (name, length) not in loaded:
            model, params, weights = load(name, length, args.new_tokens, args.seed)
            prompt = [int(t) for t in rng.randint(3, model.cfg.vocab_size, length)]
            loaded.clear()                    # one model on the device at a time
            loaded[(name, length)] = (model, params, weights, prompt)
        return loaded[(name, length)]

    def emit(record):
        records.append(record)
        print(json.dumps(record), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    # Timing rows first, then the CPU comparisons: a run cut off by a time limit keeps every
    # timing row it finished.
    phases = [("time", name, length, p) for name in models for length in lengths
              for p in policies] if "time" in phase_names else []
    if compare:
        phases += [("compare", name, length, p) for name in models for length in lengths
                   for p in policies]
    for phase, name, length, policy_name in phases:
        model, params, weights, prompt = setup(name, length)
        policy = make_policy(policy_name, budget=budget)
        record = {"phase": phase, "model": name, "weights": weights, "prompt_tokens": length,
                  "policy": policy_name, "budget": budget_record(budget),
                  "new_tokens": args.new_tokens,
                  "device": device.device_kind, "platform": device.platform,
                  "jax": jax.__version__, "unbounded": args.unbounded}
        try:
            with lifted_memory_bounds(args.unbounded):
                if phase == "time":
                    prefill_s, tok_s, _, _, _ = run_once(model, params, prompt, policy,
                                                         args.new_tokens, device)
                    record.update(prefill_s=round(prefill_s, 3),
                                  decode_tokens_per_s=round(tok_s, 2),
                                  peak_device_bytes=peak_bytes(device))
                    if args.host_loop:
                        record["host_loop_tokens_per_s"] = round(host_loop_tokens_per_s(
                            model, params, prompt, policy, args.new_tokens, device), 2)
                else:
                    small, small_params = truncated(model, params, args.cpu_layers)
                    want = run_once(small, small_params, prompt, policy, args.new_tokens, cpu,
                                    repeats=1)
                    record.update(cpu_layers=small.cfg.num_layers,
                                  logit_scale=float(np.std(want[3])))
                    if accelerated:
                        got = run_once(small, small_params, prompt, policy, args.new_tokens,
                                       device)
                        record.update(differences(got, want))
                    if args.perturb:
                        moved = run_once(small, perturbed(small_params, args.perturb, args.seed),
                                         prompt, policy, args.new_tokens, cpu, repeats=1)
                        record.update({f"{k}_perturbed": v
                                       for k, v in differences(moved, want).items()},
                                      perturb=args.perturb)
        except Exception as err:   # a row that fails (memory) is recorded, not fatal
            record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        emit(record)
    print(f"\n{'model':14s} {'T':>6s} {'policy':8s} {'prefill s':>9s} {'tok/s':>8s} "
          f"{'host tok/s':>10s} {'peak GB':>8s} {'|dlogit| cpu':>12s} {'perturbed':>10s}")
    by_key = {}
    for r in records:
        by_key.setdefault((r["model"], r["prompt_tokens"], r["policy"]), {}).update(
            {k: v for k, v in r.items() if k != "phase"})
    for r in by_key.values():
        peak = r.get("peak_device_bytes")
        diff = r.get("max_abs_logit_diff_decode")
        moved = r.get("max_abs_logit_diff_decode_perturbed")
        print(f"{r['model']:14s} {r['prompt_tokens']:6d} {r['policy']:8s} "
              f"{r.get('prefill_s', float('nan')):9.2f} {r.get('decode_tokens_per_s', float('nan')):8.1f} "
              f"{r.get('host_loop_tokens_per_s', float('nan')):10.1f} "
              f"{(peak / 1e9 if peak else float('nan')):8.2f} "
              f"{(diff if diff is not None else float('nan')):12.2e} "
              f"{(moved if moved is not None else float('nan')):10.2e} {r.get('error', '')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
