"""Cross-check of our prompt-eviction baselines against NVIDIA kvpress (a benchmark, not a test).

    bash scripts/kvpress_env.sh && .venv/bin/python -m experiments.kvpress_crosscheck --output_dir=results/kvpress_crosscheck

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
  kvpress rule  a re-implementation of kvpress's scoring rule on our model (defined below,
                diagnostic only, not a registered policy): shows whether what remains is the
                rule itself or numerics.
Outputs in --output_dir: crosscheck.jsonl (one record per prompt x method x budget x variant),
summary.md (table + explanation of each difference), prompts/ and kvpress/ (the exchange
files; a rerun reuses kvpress records of the same job). --report_only rewrites summary.md
from an existing crosscheck.jsonl.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import subprocess
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from experiments import tasks
from experiments.common import REPO_ROOT, ensure_dir, git_commit, write_jsonl
from runtime.generate import apply_policy, decode_tokens, prefill_prompt
from mpcache_jax.policies import make_policy
from mpcache_jax.policies.base import causal_attention_mass, window_attention_mass
from mpcache_jax.policies.h2o import H2O
from mpcache_jax.policies.pyramidkv import PyramidKV

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


# --- kvpress's rules on our model (diagnostic variants, not registered policies) ------------

def avg_pool_1d(x: jnp.ndarray, kernel: int) -> jnp.ndarray:
    """torch's avg_pool1d(kernel, stride 1, padding kernel // 2) with count_include_pad: the
    zero-padded window sum over the last axis divided by `kernel`."""
    half = kernel // 2
    T = x.shape[-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)])
    return sum(padded[..., i:i + T] for i in range(kernel)) / kernel


def static_length(extent) -> int:
    """The prompt length handed to keep_scores: an int (static-length policy API) or an
    mpcache_jax.extent.Extent (bucketing API); the diagnostic rules need a static length."""
    if isinstance(extent, (int, np.integer)):
        return int(extent)
    if not extent.static:
        raise ValueError("the kvpress-rule diagnostics support static prompt lengths only")
    return int(extent.length)


@dataclasses.dataclass(frozen=True)
class KvpressSnapKVRule(PyramidKV):
    """kvpress's SnapKVPress / PyramidKVPress selection: window votes average-pooled (ours:
    max-pooled), the window kept, and the given kept count per layer (window included)."""

    name: str = "kvpress_snapkv_rule"
    counts: tuple[int, ...] = ()

    def layer_counts(self, num_layers, prompt_len):
        if len(self.counts) != num_layers:
            raise ValueError(f"{len(self.counts)} layer counts for {num_layers} layers")
        return self.counts

    def keep_scores(self, layer, q, k, extent, carry):
        prompt_len = static_length(extent)
        window = min(self.window, prompt_len)
        votes = jnp.sum(window_attention_mass(q, k, window), axis=1)          # [H_kv, T]
        prefix = (np.arange(prompt_len) < prompt_len - window).astype(np.float32)
        return avg_pool_1d(votes * prefix, self.kernel), carry


@dataclasses.dataclass(frozen=True)
class KvpressObservedAttentionRule(H2O):
    """kvpress's ObservedAttentionPress: attention received averaged over the queries that
    can see the token (ours: summed), no protected recent window, no eviction while decoding
    (use with decode_window=None)."""

    name: str = "kvpress_observed_attention_rule"

    def keep_scores(self, layer, q, k, extent, carry):
        prompt_len = static_length(extent)
        received = jnp.sum(causal_attention_mass(q, k), axis=1)              # [H_kv, T]
        return received / np.arange(prompt_len, 0, -1, dtype=np.float32), carry

    def forced_keep(self, extent, count):
        return None


# --- the methods both sides implement ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Method:
    """One method: the kvpress press (+ options) and our variants.

    variants(budget, counts) -> [(label, policy)]; counts = kvpress's kept count per layer for
    this prompt and budget (a tuple of L ints), known after the kvpress side ran.
    """

    name: str
    press: str
    press_options: dict
    variants: Callable[[float, tuple], list]


def _uniform(counts) -> int:
    if len(set(counts)) != 1:
        raise ValueError(f"expected one kept count for every layer, got {sorted(set(counts))}")
    return int(counts[0])


def _pyramid_with_kvpress_hp(budget: float, counts, window: int):
    """Ours closest to kvpress's PyramidKVPress: its window and kernel; where kvpress fell back
    to one count for every layer, our SnapKV with that count, else our pyramid."""
    if len(set(counts)) == 1:
        return make_policy("snapkv", int(counts[0]), window=window, kernel=5)
    return make_policy("pyramidkv", budget, window=window, kernel=5)


METHODS = (
    Method("streaming_llm", "StreamingLLMPress", {}, lambda b, c: [
        ("ours", make_policy("streaming_llm", b)),
        ("ours+kvp.hp", make_policy("streaming_llm", _uniform(c), num_sinks=4)),
    ]),
    Method("snapkv", "SnapKVPress", {}, lambda b, c: [
        ("ours", make_policy("snapkv", b)),
        ("ours+kvp.hp", make_policy("snapkv", _uniform(c), window=64, kernel=5)),
        ("kvpress rule", KvpressSnapKVRule(budget=_uniform(c), window=64, kernel=5,
                                           counts=tuple(c))),
    ]),
    Method("tova", "TOVAPress", {}, lambda b, c: [
        ("ours", make_policy("tova", b)),
        ("ours+kvp.hp", make_policy("tova", _uniform(c), decode_window=None)),
    ]),
    Method("h2o", "ObservedAttentionPress", {}, lambda b, c: [
        ("ours", make_policy("h2o", b)),
        ("ours+kvp.hp", make_policy("h2o", _uniform(c), decode_window=None)),
        ("kvpress rule", KvpressObservedAttentionRule(budget=_uniform(c), decode_window=None)),
    ]),
    # kvpress's PyramidKVPress falls back to uniform SnapKV budgets unless the top layer's
    # share (kept / beta) reaches its window: never at <= 1280 kept tokens with window 64.
    Method("pyramidkv", "PyramidKVPress", {}, lambda b, c: [
        ("ours", make_policy("pyramidkv", b)),
        ("ours+kvp.hp", _pyramid_with_kvpress_hp(b, c, window=64)),
        ("kvpress rule", KvpressSnapKVRule(budget=max(c), window=64, kernel=5,
                                           counts=tuple(c))),
    ]),
    # With a 4-token window kvpress's pyramid does engage at 10-20% of ~1k tokens.
    Method("pyramidkv_w4", "PyramidKVPress", {"window_size": 4}, lambda b, c: [
        ("ours+kvp.hp", _pyramid_with_kvpress_hp(b, c, window=4)),
        ("kvpress rule", KvpressSnapKVRule(budget=max(c), window=4, kernel=5,
                                           counts=tuple(c))),
    ]),
)
METHOD_NAMES = tuple(m.name for m in METHODS)


def run_key(method: Method, budget: float) -> str:
    return f"{method.name}@{budget:g}"


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


# --- comparison ------------------------------------------------------------------------------

def truncate(tokens, stop_ids) -> list[int]:
    """Tokens up to and including the first stop token."""
    out = []
    for t in tokens:
        out.append(int(t))
        if int(t) in stop_ids:
            break
    return out


def greedy_agreement(ours, theirs, stop_ids) -> dict:
    a, b = truncate(ours, stop_ids), truncate(theirs, stop_ids)
    prefix = 0
    for x, y in zip(a, b):
        if x != y:
            break
        prefix += 1
    return {"exact": a == b, "common_prefix": prefix, "length_ours": len(a),
            "length_kvpress": len(b)}


def kept_overlap(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Per layer and KV head Jaccard and recall of kvpress's set, averaged; kept counts."""
    inter = (ours & theirs).sum(-1).astype(np.float64)
    union = (ours | theirs).sum(-1)
    return {"jaccard": float((inter / np.maximum(union, 1)).mean()),
            "recall": float((inter / np.maximum(theirs.sum(-1), 1)).mean()),
            "kept_ours": float(ours.sum(-1).mean()), "kept_kvpress": float(theirs.sum(-1).mean()),
            "jaccard_per_layer": (inter / np.maximum(union, 1)).mean(-1).round(4).tolist()}


# --- report ----------------------------------------------------------------------------------

EXPLANATIONS = {
    "budget": (
        "**Budget accounting.** Ours keeps ceil(budget x T) prompt tokens per layer; kvpress "
        "keeps int(T x (1 - compression_ratio)) and 1 - 0.9 = 0.09999999999999998 in floating "
        "point, so it floors e.g. 99.99999999999997 to 99 (PyramidKVPress's fallback uses "
        "round() instead). Measured kept counts per layer, ours / kvpress: {counts}. Both "
        "compress the whole prompt here: the crosscheck prefills the full prompt (question "
        "included) under the press, as our policies do; kvpress's own pipeline would compress "
        "only the context and append the question uncompressed. Both attend to every "
        "generated token afterwards."),
    "numerics": (
        "**Numerics.** Our JAX SmolLM2 and transformers' LlamaForCausalLM (same GGUF, float32) "
        "agree to ~1e-4 in logits (the `full` row). Where both sides apply the same rule, a "
        "Jaccard just below 1 is a near-tie in the scores flipped by float32 rounding (torch vs "
        "XLA), not a difference of method; identical kept sets gave identical greedy tokens."),
    "streaming_llm": (
        "**StreamingLLM.** Same rule on both sides: 4 sink tokens + the most recent tokens, one "
        "set for every layer and head. The only difference is the count (above): with "
        "kvpress's count (`ours+kvp.hp`) the kept sets are identical."),
    "snapkv": (
        "**SnapKV.** Same structure (the last `window` queries vote, votes smoothed along the "
        "sequence, top-k per KV head, the window always kept, GQA votes pooled over the "
        "group), different hyperparameters and smoothing: kvpress window 64, kernel 5, "
        "*average* pooling (zero padding counted) of votes averaged over the window and the "
        "group; ours window 32, kernel 7, *max* pooling of votes summed over window and group "
        "(the SnapKV reference code makes the pooling configurable, average by default; "
        "ours is fixed to max). Sum vs mean does not change a ranking; the "
        "window, the kernel and max vs average pooling do. `ours+kvp.hp` matches window, "
        "kernel and count (max pooling remains: it is not an option of ours); `kvpress rule` "
        "also average-pools."),
    "tova": (
        "**TOVA.** Same prefill rule: the last prompt query's attention averaged over all 9 "
        "heads, one set per layer. kvpress scores only the keys before the last token and "
        "forces the last token in; ours scores all keys (the last token's own attention is "
        "high, so it is kept anyway). The difference is in decoding: kvpress's TOVAPress "
        "compresses only at prefill; our TOVA keeps evicting while decoding once its 16 "
        "decode slots are full (`decode_window`), so from the 17th new token on it attends to "
        "a different set. `ours+kvp.hp` = kvpress's count and `decode_window=None` (prefill "
        "only)."),
    "h2o": (
        "**H2O vs ObservedAttentionPress** (kvpress's H2O-like press; it needs eager attention "
        "to read the attention matrix). Both score a token by the attention it receives from "
        "every prompt query, per KV head (GQA group pooled). kvpress divides that sum by the "
        "number of queries that can see the token (T - t, causal), which lifts late tokens, "
        "and keeps the top-k with nothing forced; ours (the H2O paper) sums without "
        "normalising, keeps the newest half of the budget as a recent window and the best "
        "half as heavy hitters, and keeps evicting while decoding. Only the decode eviction "
        "and the count are options of ours (`ours+kvp.hp`); `kvpress rule` = mean over "
        "visible queries, no recent window, prefill-only."),
    "pyramidkv": (
        "**PyramidKV.** kvpress's PyramidKVPress computes per-layer budgets as in "
        "KVCache-Factory: the top layer gets kept/beta, the bottom 2 x kept - kept/beta, the "
        "window counted inside each layer's budget, rounded; but it falls back to uniform "
        "SnapKV budgets (round(T x (1 - ratio)) per layer) whenever kept/beta < window, i.e. "
        "with window 64 and beta 20 for every budget below 1280 kept tokens: on ~1k-token "
        "prompts kvpress's PyramidKV *is* SnapKV (window 64, kernel 5, average pooling). Ours "
        "always applies the pyramid (window 32 outside it, the remaining budget spread "
        "R/beta .. 2R - R/beta, floored). `ours+kvp.hp` is therefore our SnapKV with window "
        "64, kernel 5 and kvpress's count; `kvpress rule` adds average pooling. "
        "`pyramidkv_w4` runs kvpress with window_size=4 so that its pyramid engages (kept/20 "
        ">= 4): our PyramidKV with window 4, kernel 5 then differs in the layer budgets "
        "(window inside vs outside the pyramid, round vs floor) and in pooling; `kvpress "
        "rule` uses kvpress's recorded per-layer counts and average pooling. PyramidKVPress "
        "itself runs here because decoding uses sdpa attention; with eager attention (which "
        "ObservedAttentionPress needs) decoding after an engaged pyramid fails with 'The size "
        "of tensor a (378) must match the size of tensor b (391) at non-singleton dimension "
        "3': transformers builds one causal mask from layer 0's cache length, and the layers "
        "hold different counts (the error ../shared/STACK.md recorded)."),
}


def aggregate(records: list[dict]) -> list[dict]:
    """Mean over prompts per (method, budget, variant), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], r["budget"], r["variant"]), []).append(r)
    rows = []
    for (method, budget, variant), rs in groups.items():
        ok = [r for r in rs if r.get("error") is None]
        row = {"method": method, "budget": budget, "variant": variant, "n": len(rs),
               "errors": len(rs) - len(ok)}
        if ok:
            with_kept = [r for r in ok if r.get("jaccard") is not None]
            for field in ("jaccard", "recall", "kept_ours", "kept_kvpress"):
                row[field] = (float(np.mean([r[field] for r in with_kept]))
                              if with_kept else None)
            row["exact"] = sum(r["exact"] for r in ok)
            row["common_prefix"] = float(np.mean([r["common_prefix"] for r in ok]))
            row["length_kvpress"] = float(np.mean([r["length_kvpress"] for r in ok]))
            row["max_logit_diff"] = (max(r["max_logit_diff"] for r in ok)
                                     if "max_logit_diff" in ok[0] else None)
        rows.append(row)
    return rows


def _fmt(value, pattern="{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def table(rows: list[dict], max_new_tokens: int) -> str:
    head = ("| method | budget | variant | kept/layer ours / kvpress | Jaccard | recall | "
            "greedy exact | common prefix / kvpress length |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if r.get("exact") is None:
            lines.append(f"| {r['method']} | {r['budget']} | {r['variant']} | kvpress failed "
                         f"on {r['errors']}/{r['n']} prompts | | | | |")
            continue
        kept = (f"{_fmt(r['kept_ours'], '{:.1f}')} / {_fmt(r['kept_kvpress'], '{:.1f}')}"
                if r.get("kept_ours") is not None else "-")
        extra = f" (max abs logit diff {r['max_logit_diff']:.1e})" if r.get("max_logit_diff") else ""
        lines.append(f"| {r['method']} | {r['budget']} | {r['variant']}{extra} | {kept} | "
                     f"{_fmt(r.get('jaccard'))} | {_fmt(r.get('recall'))} | "
                     f"{r['exact']}/{r['n'] - r['errors']} | "
                     f"{r['common_prefix']:.1f} / {r['length_kvpress']:.1f} |")
    return head + "\n".join(lines) + "\n"


def budget_counts(records: list[dict]) -> str:
    """Mean kept tokens per layer of the registered (`ours`) variants vs kvpress, grouped:
    'budget 0.1 of T = 1000: 100 / 99 (h2o, snapkv), ...'."""
    pairs: dict[tuple, dict[tuple, set]] = {}
    for r in records:
        if r.get("variant") == "ours" and r.get("kept_ours") is not None:
            pairs.setdefault((r["budget"], r["prompt_tokens"]), {}).setdefault(
                (r["kept_ours"], r["kept_kvpress"]), set()).add(r["method"])
    parts = []
    for (budget, T), counts in sorted(pairs.items()):
        listed = ", ".join(f"{ours:g} / {theirs:g} ({', '.join(sorted(methods))})"
                           for (ours, theirs), methods in sorted(counts.items()))
        parts.append(f"budget {budget:g} of T = {T}: {listed}")
    return "; ".join(parts)


def verdicts(rows: list[dict]) -> list[str]:
    """Per method: the first variant of ours that keeps exactly kvpress's tokens (Jaccard
    >= 0.999 at every budget) and whether its greedy outputs then all agree."""
    lines = []
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "full"):
        mine = [r for r in rows if r["method"] == method and r.get("jaccard") is not None]
        budgets = {r["budget"] for r in mine}
        for variant in dict.fromkeys(r["variant"] for r in mine):
            vr = [r for r in mine if r["variant"] == variant]
            if len(vr) == len(budgets) and all(r["jaccard"] >= 0.999 for r in vr):
                same = all(r["exact"] == r["n"] - r["errors"] for r in vr)
                outputs = "all identical" if same else "NOT all identical"
                lines.append(f"- {method}: `{variant}` keeps the same tokens as kvpress (Jaccard "
                             f">= 0.999 in every record); greedy outputs {outputs}.")
                break
        else:
            lines.append(f"- {method}: no variant of ours keeps exactly kvpress's tokens.")
    return lines


def write_summary(out: pathlib.Path, records: list[dict], max_new_tokens: int) -> str:
    """summary.md from the records: the table, kvpress failures, the explanations."""
    rows = aggregate(records)
    prompts = sorted({(r["prompt"], r["prompt_tokens"]) for r in records})
    failures = sorted({(r["prompt"], r["method"], r["budget"], r["error"])
                       for r in records if r.get("error")})
    text = [
        "# Our baselines vs NVIDIA kvpress 0.5.5 (SmolLM2-135M-Instruct, same GGUF)",
        "",
        "`bash scripts/kvpress_env.sh && .venv/bin/python -m experiments.kvpress_crosscheck "
        f"--output_dir={FLAGS.output_dir}`  (commit {git_commit()})",
        "",
        f"{len(prompts)} prompts ({', '.join(p for p, _ in prompts)}; "
        f"{sorted({t for _, t in prompts})} tokens); {max_new_tokens} greedy tokens from the "
        "compressed cache, compared up to the first stop token. Jaccard / recall = "
        "|ours n kvpress| / |ours u kvpress| and / |kvpress| per layer and KV head, averaged "
        "over layers, heads and prompts. `ours` = the registered policy; `ours+kvp.hp` = ours "
        "with kvpress's hyperparameters and kept count; `kvpress rule` = kvpress's scoring "
        "re-implemented on our model (diagnostic).",
        "",
        table(rows, max_new_tokens),
    ]
    text += ["## Verdict per method", ""] + verdicts(rows) + [""]
    if failures:
        text += ["## kvpress failures", ""]
        text += [f"- {method} at {budget:g} on {prompt}: {error}"
                 for prompt, method, budget, error in failures]
        text.append("")
    text += ["## Differences, from reading both implementations", ""]
    text += [EXPLANATIONS["budget"].format(counts=budget_counts(records)) + "\n"]
    text += [EXPLANATIONS[m] + "\n" for m in EXPLANATIONS if m != "budget"]
    body = "\n".join(text)
    (out / "summary.md").write_text(body)
    return table(rows, max_new_tokens)


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
