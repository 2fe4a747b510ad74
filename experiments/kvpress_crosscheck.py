"""Cross-check of our prompt-eviction baselines against NVIDIA kvpress (a benchmark, not a test).

    bash scripts/kvpress_env.sh && .venv/bin/mpcache kvpress-crosscheck --output_dir=results/kvpress_crosscheck

Options: --prompts=FILE.jsonl ({"id", "prompt_ids": [...]} per line; default: 3 kv_retrieval +
3 needle prompts of --length=1000 tokens, seed 0), --budgets=0.1,0.2 (fraction of the prompt
KEPT; kvpress gets compression_ratio = 1 - budget, the fraction REMOVED), --methods=...,
--max_new_tokens=24. ~1 h on 2 busy cores (kvpress: 78 runs of ~25 s; ours: ~30 programs
to compile, then ~180 compress + decode runs).

kvpress needs numpy >= 2 and transformers < 5.3, so it runs in its own venv
(.venv-kvpress, from requirements-kvpress.txt) as a subprocess: experiments/kvpress_side.py
loads SmolLM2 with transformers straight from the same GGUF, applies each press at prefill,
records which prompt positions every layer / KV head kept and the greedy tokens. Data crosses
the process boundary only as JSON and .npy (allow_pickle=False). Then this process runs our
policies on our JAX model over the same prompts and compares, per prompt x method x budget:
  - kept tokens per layer and KV head: Jaccard |A n B| / |A u B| and recall |A n B| / |B|
    (B = kvpress's set), averaged over layers and heads;
  - greedy output from the compressed cache (both truncated after the first stop token):
    exact match of the sequence and length of the common prefix;
  - full cache, ours vs transformers: greedy tokens and max |logit difference| (sanity).
Each method is compared in up to three variants of our side:
  ours          the registered policy at the budget (make_policy(name, budget));
  ours+kvp.hp   our policy with kvpress's hyperparameters where they are options (window,
                kernel, prefill-only eviction) and kvpress's exact kept count as the budget;
  kvpress rule  a re-implementation of kvpress's scoring rule on our model (kvpress_methods.py,
                diagnostic only, not a registered policy): shows whether what remains is the
                rule itself or numerics.
The methods and kvpress's rules are in kvpress_methods.py, the comparison and summary.md in
kvpress_report.py. Outputs in --output_dir: crosscheck.jsonl (one record per prompt x method x budget x variant),
summary.md (table + explanation of each difference), prompts/ and kvpress/ (the exchange
files; a rerun reuses kvpress records of the same job). --report_only rewrites summary.md
from an existing crosscheck.jsonl.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import time

import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from experiments import tasks
from experiments.common import REPO_ROOT, ensure_dir, write_jsonl
from experiments.kvpress_methods import METHOD_NAMES, METHODS, Method, run_key
from experiments.kvpress_report import greedy_agreement, kept_overlap, write_summary
from mpcache_jax.policies import make_policy
from runtime.generate import apply_policy, decode_tokens, prefill_prompt

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "results/kvpress_crosscheck", "where results are written")
flags.DEFINE_string("prompts", None, "JSONL of {'id', 'prompt_ids'}; default: task prompts")
flags.DEFINE_integer("num_prompts", 6, "default prompts: half kv_retrieval, half needle")
flags.DEFINE_integer("length", 1000, "default prompts: tokens per prompt")
flags.DEFINE_integer("seed", 0, "default prompts: task seed")
flags.DEFINE_list("budgets", ["0.1", "0.2"], "fractions of the prompt kept")
flags.DEFINE_list("methods", None, "subset of the methods (default: all)")
flags.DEFINE_integer("max_new_tokens", 24, "greedy tokens after the compressed prefill")
flags.DEFINE_string("kvpress_python", str(REPO_ROOT / ".venv-kvpress" / "bin" / "python"),
                    "python of the kvpress venv (scripts/kvpress_env.sh)")
flags.DEFINE_string("model", "smollm2-135m", "our model (must be the GGUF SmolLM2)")
flags.DEFINE_bool("report_only", False, "rewrite summary.md from --output_dir's crosscheck.jsonl")

SIDE_SCRIPT = REPO_ROOT / "experiments" / "kvpress_side.py"

# --- prompts ---------------------------------------------------------------------------------

def default_prompts(tokenizer, num_prompts: int, length: int, seed: int) -> list[dict]:
    """Deterministic kv_retrieval and needle prompts of exactly `length` tokens."""
    n_kv = (num_prompts + 1) // 2
    n_needle = num_prompts - n_kv
    samples = list(tasks.kv_retrieval(tokenizer, num_samples=n_kv, lengths=[length], seed=seed))
    if n_needle:
        depths = [round(float(d), 2) for d in np.linspace(0.2, 0.8, n_needle)]
        samples += list(tasks.needle(tokenizer, num_samples=n_needle, lengths=[length],
                                     depths=depths, seed=seed))
    return [{"id": s.sample_id, "prompt_ids": list(s.prompt_ids)} for s in samples]


def read_prompts(path: str) -> list[dict]:
    prompts = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "id" not in record or "prompt_ids" not in record:
                raise SystemExit(f"{path}:{line_no}: each line needs 'id' and 'prompt_ids'")
            ids = record["prompt_ids"]
            if not ids or not all(isinstance(t, int) for t in ids):
                raise SystemExit(f"{path}:{line_no}: 'prompt_ids' must be a list of token ids")
            prompts.append({"id": str(record["id"]), "prompt_ids": ids})
    if not prompts:
        raise SystemExit(f"{path} holds no prompts")
    if len({p["id"] for p in prompts}) != len(prompts):
        raise SystemExit(f"{path}: prompt ids must be unique")
    return prompts


# --- the kvpress side (subprocess) -----------------------------------------------------------

def write_job(out: pathlib.Path, prompts, methods, budgets, max_new_tokens: int,
              gguf: pathlib.Path) -> pathlib.Path:
    """Prompt .npy files + job.json for kvpress_side.py; the job hash covers everything that
    determines its results (prompts, presses, the side script and the kvpress pins)."""
    ids_dir = ensure_dir(out / "prompts")
    entries = []
    for p in prompts:
        np.save(ids_dir / f"{p['id']}.npy", np.asarray(p["prompt_ids"], np.int32),
                allow_pickle=False)
        entries.append({"id": p["id"], "ids_file": f"prompts/{p['id']}.npy"})
    runs = [{"key": "full", "press": "full", "options": {}}]
    for method in methods:
        for budget in budgets:
            runs.append({"key": run_key(method, budget), "press": method.press,
                         "options": {**method.press_options,
                                     "compression_ratio": round(1.0 - budget, 6)}})
    digest = hashlib.sha256()
    digest.update(json.dumps([prompts, runs, max_new_tokens]).encode())
    digest.update(SIDE_SCRIPT.read_bytes())
    digest.update((REPO_ROOT / "requirements-kvpress.txt").read_bytes())
    job = {"gguf_dir": str(gguf.parent), "gguf_file": gguf.name, "prompts": entries,
           "runs": runs, "max_new_tokens": max_new_tokens, "job_hash": digest.hexdigest()}
    path = out / "job.json"
    path.write_text(json.dumps(job, indent=1))
    return path


def run_kvpress_side(job_path: pathlib.Path, python: str) -> dict[tuple[str, str], dict]:
    """Run kvpress_side.py in the kvpress venv (progress from its stdout, log in
    kvpress/side.log) -> {(prompt, key): record}."""
    if not pathlib.Path(python).is_file():
        raise SystemExit(f"{python} not found: create the kvpress venv first with "
                         "`bash scripts/kvpress_env.sh`")
    job = json.loads(job_path.read_text())
    total = len(job["prompts"]) * len(job["runs"])
    log_path = ensure_dir(job_path.parent / "kvpress") / "side.log"
    # Offline: transformers reads the local GGUF and must never reach for a model hub.
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "w") as log, tqdm(total=total, desc="kvpress", unit="run") as bar:
        proc = subprocess.Popen([python, str(SIDE_SCRIPT), str(job_path)], stdout=subprocess.PIPE,
                                stderr=log, text=True, env=env, cwd=REPO_ROOT)
        for line in proc.stdout:
            if line.startswith("done "):
                bar.update(1)
                bar.set_postfix_str(line.split(" ", 1)[1].strip())
        code = proc.wait()
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise SystemExit(f"kvpress side failed (exit {code}); end of {log_path}:\n{tail}")
    records = {}
    for line in (job_path.parent / "kvpress" / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("job_hash") == job["job_hash"]:
            records[(record["prompt"], record["key"])] = record
    return records


def load_npy(out: pathlib.Path, name: str) -> np.ndarray:
    return np.load(out / "kvpress" / name, allow_pickle=False)


# --- our side --------------------------------------------------------------------------------

def match_rows(kept: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Prompt positions of the kept key rows. kept: [n, d]; keys: [T, d] -> int [n]."""
    distance = ((kept[:, None, :].astype(np.float64) - keys[None, :, :]) ** 2).sum(-1)
    best = distance.argmin(axis=1)
    scale = float((keys.astype(np.float64) ** 2).sum(-1).max())
    if distance[np.arange(len(best)), best].max() > 1e-10 * scale:
        raise RuntimeError("a kept key row matches no prompt position")
    if len(set(best.tolist())) != len(best):
        raise RuntimeError("two kept key rows map to the same prompt position")
    return best


def our_kept_mask(compressed, dense, prompt_len: int) -> np.ndarray:
    """uint8 [L, H_kv, T]: which prompt positions each layer / KV head of our compressed cache
    holds. Decode-eviction buffers (H2O, TOVA) carry positions; pruned layers are matched row
    by row against the dense prefill keys (the compaction is a one-hot gather: exact copies)."""
    masks = []
    for state, layer in zip(compressed, dense):
        Hkv = layer.k.shape[0]
        mask = np.zeros((Hkv, prompt_len), np.uint8)
        valid = np.asarray(state.valid) > 0.5
        if hasattr(state, "pos"):
            pos = np.asarray(state.pos)
            for h in range(Hkv):
                mask[h, pos[h, valid[h]].astype(np.int64)] = 1
        elif hasattr(state, "k"):
            kept = np.asarray(state.k)
            keys = np.asarray(layer.k[:, :prompt_len])
            for h in range(Hkv):
                mask[h, match_rows(kept[h, valid[h]], keys[h])] = 1
        else:
            raise TypeError(f"cannot read kept positions from {type(state).__name__}")
        masks.append(mask)
    return np.stack(masks)


def our_prompt_runs(lm, prompt_ids, jobs, max_new_tokens: int, bar) -> tuple[dict, dict]:
    """One prefill, then full + every (key, label, policy) in `jobs` ->
    ({"tokens", "first_logits"} for full, {(key, label): {"tokens", "kept", "seconds"}})."""
    model, params = lm.model, lm.params
    T = len(prompt_ids)
    logits, dense, aux = prefill_prompt(model, params, prompt_ids, max_new_tokens,
                                        return_queries=True)
    full_policy = make_policy("full")
    cache = apply_policy(full_policy, dense, aux, max_new_tokens)
    result = decode_tokens(model, params, logits, cache, policy=full_policy, start_pos=T,
                           max_new_tokens=max_new_tokens)
    full = {"tokens": result.tokens, "first_logits": np.asarray(logits, np.float32)}
    bar.update(1)
    runs = {}
    for key, label, policy in jobs:
        start = time.perf_counter()
        cache = apply_policy(policy, dense, aux, max_new_tokens)
        kept = our_kept_mask(cache, dense, T)   # before decoding: decode donates the cache
        result = decode_tokens(model, params, logits, cache, policy=policy, start_pos=T,
                               max_new_tokens=max_new_tokens)
        runs[(key, label)] = {"tokens": result.tokens, "kept": kept,
                              "seconds": round(time.perf_counter() - start, 2)}
        bar.update(1)
    return full, runs

# --- main ------------------------------------------------------------------------------------

def selected_methods() -> list[Method]:
    if not FLAGS.methods:
        return list(METHODS)
    unknown = sorted(set(FLAGS.methods) - set(METHOD_NAMES))
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {', '.join(METHOD_NAMES)}")
    return [m for m in METHODS if m.name in FLAGS.methods]


def parse_budgets() -> list[float]:
    budgets = []
    for text in FLAGS.budgets:
        value = float(text)
        if not 0.0 < value < 1.0:
            raise SystemExit(f"--budgets: {text} must be a fraction in (0, 1) of the prompt kept")
        budgets.append(value)
    return budgets


def compare_prompt(prompt, kv, full, ours, methods, budgets, stop_ids, out) -> list[dict]:
    """Records of one prompt: full-cache sanity + every method x budget x variant."""
    pid = prompt["id"]
    kv_full = kv[(pid, "full")]
    their_logits = load_npy(out, kv_full["first_logits_file"])
    base = {"prompt": pid, "prompt_tokens": len(prompt["prompt_ids"])}
    records = [{**base, "method": "full", "budget": 1.0, "variant": "ours vs transformers",
                "tokens_ours": full["tokens"], "tokens_kvpress": kv_full["tokens"],
                "max_logit_diff": float(np.abs(full["first_logits"] - their_logits).max()),
                **greedy_agreement(full["tokens"], kv_full["tokens"], stop_ids)}]
    for method in methods:
        for budget in budgets:
            key = run_key(method, budget)
            theirs = kv[(pid, key)]
            common = {**base, "method": method.name, "budget": budget,
                      "press": theirs["press"], "press_options": theirs["options"]}
            if theirs.get("error"):
                records.append({**common, "variant": "kvpress", "error": theirs["error"]})
                continue
            for (k, label), run in ours.items():
                if k != key:
                    continue
                rec = {**common, "variant": label}
                kept_theirs = load_npy(out, theirs["kept_file"]).astype(bool)
                rec.update(kept_overlap(run["kept"].astype(bool), kept_theirs))
                rec.update(greedy_agreement(run["tokens"], theirs["tokens"], stop_ids))
                rec.update(tokens_ours=run["tokens"], tokens_kvpress=theirs["tokens"],
                           ours_vs_own_full=greedy_agreement(run["tokens"], full["tokens"],
                                                             stop_ids)["common_prefix"],
                           kvpress_vs_own_full=greedy_agreement(
                               theirs["tokens"], kv_full["tokens"], stop_ids)["common_prefix"],
                           kvpress_seconds=theirs["seconds"], ours_seconds=run["seconds"])
                records.append(rec)
    return records


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)   # orbax's restore chatter
    if FLAGS.report_only:
        out = pathlib.Path(FLAGS.output_dir)
        records = [json.loads(line) for line in (out / "crosscheck.jsonl").read_text().splitlines()]
        print(write_summary(out, records, FLAGS.max_new_tokens))
        return
    from models import registry, smollm2
    methods, budgets = selected_methods(), parse_budgets()
    out = ensure_dir(FLAGS.output_dir)
    if not pathlib.Path(FLAGS.kvpress_python).is_file():
        raise SystemExit(f"{FLAGS.kvpress_python} not found: create the kvpress venv first with "
                         "`bash scripts/kvpress_env.sh`")
    print(f"loading {FLAGS.model} (ours)", flush=True)
    lm = registry.load(FLAGS.model)
    prompts = (read_prompts(FLAGS.prompts) if FLAGS.prompts else
               default_prompts(lm.tokenizer, FLAGS.num_prompts, FLAGS.length, FLAGS.seed))
    job = write_job(out, prompts, methods, budgets, FLAGS.max_new_tokens, smollm2.fetch_gguf())
    kv = run_kvpress_side(job, FLAGS.kvpress_python)

    stop_ids = set(lm.tokenizer.stop_ids)
    records = []
    jobs_per_prompt = {}
    for p in prompts:
        jobs = []
        for method in methods:
            for budget in budgets:
                theirs = kv[(p["id"], run_key(method, budget))]
                if theirs.get("error"):
                    continue        # nothing to compare with; recorded as a failure
                counts = tuple(row[0] for row in theirs["kept_counts"])   # per layer, head 0
                jobs += [(run_key(method, budget), label, policy)
                         for label, policy in method.variants(budget, counts)]
        jobs_per_prompt[p["id"]] = jobs
    total = sum(len(j) + 1 for j in jobs_per_prompt.values())
    with tqdm(total=total, desc="ours", unit="run") as bar:
        for p in prompts:
            bar.set_postfix_str(p["id"])
            full, ours = our_prompt_runs(lm, p["prompt_ids"], jobs_per_prompt[p["id"]],
                                         FLAGS.max_new_tokens, bar)
            records += compare_prompt(p, kv, full, ours, methods, budgets, stop_ids, out)
    write_jsonl(out / "crosscheck.jsonl", records)
    print(write_summary(out, records, FLAGS.max_new_tokens))
    failures = {f"{r['method']}@{r['budget']:g}: {r['error']}" for r in records if r.get("error")}
    if failures:
        print("kvpress failures:", *sorted(failures), sep="\n  ")
    print(f"wrote {out / 'crosscheck.jsonl'} and {out / 'summary.md'}")


if __name__ == "__main__":
    app.run(main)
