"""The NVIDIA kvpress side of experiments/kvpress_crosscheck.py (runs in .venv-kvpress).

    .venv-kvpress/bin/python experiments/kvpress_side.py JOB.json

Started by kvpress_crosscheck.py; imports only torch, transformers, kvpress, numpy, json (and
the standard library), never the project. Data comes in and goes out as JSON and .npy only.

JOB.json:
  gguf_dir, gguf_file    the SmolLM2 GGUF, loaded by transformers itself (no model hub)
  prompts                [{"id": str, "ids_file": "prompt_ids/<id>.npy"}]  (int32 [T], relative
                         to the job file's directory)
  runs                   [{"key": str, "press": "full" | a kvpress class name,
                           "options": {constructor kwargs, e.g. compression_ratio}}]
  max_new_tokens         greedy tokens after prefill (no early stop: the caller truncates)
  job_hash               copied into every record; records of another job are redone
Writes into the job file's directory:
  kvpress/results.jsonl  one line per prompt x run: {"job_hash", "prompt", "key", "tokens",
                         "kept_counts" [L][H_kv], "kept_file", "first_logits_file", "seconds",
                         "error"}
  kvpress/<prompt>__<key>.kept.npy         uint8 [L, H_kv, T]: 1 = the press kept that position
  kvpress/<prompt>__<key>.logits.npy       float32 [V]: logits of the last prompt position
and prints "done <prompt> <key>" on stdout after each run (the caller's progress bar).

How kept positions are captured: the press's `compress` is wrapped per instance; the wrapper
calls the press's own compress and maps every kept key row back to its prompt position by
exact row match against the uncompressed keys (a gather copies rows bit for bit), so what is
recorded is what the press really kept, whatever its scoring and budget rules.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import sys
import time
import traceback

import numpy as np
import torch
import transformers

import kvpress

# Presses whose scores read the attention matrix of the prefill (output[1] of the attention
# layer): they need the eager attention implementation during prefill.
NEEDS_ATTENTIONS = {"ObservedAttentionPress"}


def load_model(gguf_dir: str, gguf_file: str):
    """SmolLM2 as transformers' LlamaForCausalLM straight from the GGUF (float32, CPU, eval)."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_file, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def kept_positions(original: torch.Tensor, kept: torch.Tensor) -> np.ndarray:
    """0/1 mask [H_kv, T] of the prompt positions whose key rows survive in `kept`.

    original: [1, H_kv, T, d] keys before compression; kept: [1, H_kv, n, d] after.
    """
    H, T = original.shape[1], original.shape[2]
    mask = np.zeros((H, T), np.uint8)
    for h in range(H):
        distance = torch.cdist(kept[0, h].double(), original[0, h].double(),
                               compute_mode="donot_use_mm_for_euclid_dist")      # [n, T]
        best = distance.argmin(dim=1)
        worst = distance.gather(1, best[:, None]).max().item()
        if worst > 1e-6:
            raise RuntimeError(f"a kept key row matches no prompt position (distance {worst:g}): "
                               "the press modified keys instead of selecting them")
        mask[h, best.numpy()] = 1
        if int(mask[h].sum()) != kept.shape[2]:
            raise RuntimeError("two kept key rows map to the same prompt position")
    return mask


def capture_compress(press, masks: dict[int, np.ndarray]) -> None:
    """Record the kept positions of every compressed layer into masks[layer_idx]."""
    inner = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = inner(module, hidden_states, keys, values, attentions, kwargs)
        masks[module.layer_idx] = kept_positions(keys, new_keys)
        return new_keys, new_values

    press.compress = compress


def make_press(name: str, options: dict):
    if not hasattr(kvpress, name):
        raise ValueError(f"kvpress has no press {name!r}")
    return getattr(kvpress, name)(**options)


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor, press, max_new_tokens: int, prefill_attn: str):
    """Prefill (compressed by `press` if given), then greedy decode as kvpress's pipeline does:
    explicit position ids continue at T, the cache holds only what the press kept.
    Returns (tokens, last prompt logits)."""
    cache = transformers.DynamicCache()
    T = prompt.shape[1]
    model.set_attn_implementation(prefill_attn)
    context = press(model) if press is not None else contextlib.nullcontext()
    with context:
        out = model(input_ids=prompt, past_key_values=cache, logits_to_keep=1)
    # Decoding with sdpa: eager builds one mask from layer 0's cache length, which breaks when
    # layers keep different counts (PyramidKV); sdpa needs no mask for one query.
    model.set_attn_implementation("sdpa")
    first_logits = out.logits[0, -1].float().numpy()
    tokens = [int(out.logits[0, -1].argmax())]
    for step in range(max_new_tokens - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                    position_ids=torch.tensor([[T + step]]))
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, first_logits


def run_one(model, prompt_ids: np.ndarray, run: dict, max_new_tokens: int, out_dir: pathlib.Path,
            prompt_name: str) -> dict:
    """One prompt x run -> record (kept mask and logits saved as .npy)."""
    stem = f"{prompt_name}__{run['key']}"
    record = {"prompt": prompt_name, "key": run["key"], "press": run["press"],
              "options": run.get("options", {})}
    start = time.perf_counter()
    prompt = torch.from_numpy(prompt_ids.astype(np.int64))[None, :]
    masks: dict[int, np.ndarray] = {}
    press = None
    if run["press"] != "full":
        press = make_press(run["press"], run.get("options", {}))
        capture_compress(press, masks)
    attn = "eager" if run["press"] in NEEDS_ATTENTIONS else "sdpa"
    try:
        tokens, first_logits = greedy(model, prompt, press, max_new_tokens, attn)
    except Exception as exc:   # a press failing on this model is a result, not a crash
        record.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                      seconds=round(time.perf_counter() - start, 2))
        return record
    record["tokens"] = tokens
    logits_file = out_dir / f"{stem}.logits.npy"
    np.save(logits_file, first_logits.astype(np.float32), allow_pickle=False)
    record["first_logits_file"] = logits_file.name
    if press is not None:
        if len(masks) != model.config.num_hidden_layers:
            raise RuntimeError(f"{run['press']} compressed {len(masks)} of "
                               f"{model.config.num_hidden_layers} layers")
        kept = np.stack([masks[i] for i in range(len(masks))])                 # [L, H_kv, T]
        kept_file = out_dir / f"{stem}.kept.npy"
        np.save(kept_file, kept, allow_pickle=False)
        record["kept_file"] = kept_file.name
        record["kept_counts"] = kept.sum(axis=2).tolist()
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def finished(results: pathlib.Path, job_hash: str) -> set[tuple[str, str]]:
    """(prompt, key) pairs already recorded for this job (a rerun resumes)."""
    done = set()
    if results.is_file():
        for line in results.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("job_hash") == job_hash:
                    done.add((rec["prompt"], rec["key"]))
    return done


def main(job_path: str) -> int:
    job_file = pathlib.Path(job_path)
    job = json.loads(job_file.read_text())
    base = job_file.parent
    out_dir = base / "kvpress"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    done = finished(results, job["job_hash"])
    torch.manual_seed(0)
    model = load_model(job["gguf_dir"], job["gguf_file"])
    for prompt in job["prompts"]:
        ids = np.load(base / prompt["ids_file"], allow_pickle=False)
        for run in job["runs"]:
            if (prompt["id"], run["key"]) not in done:
                record = run_one(model, ids, run, job["max_new_tokens"], out_dir, prompt["id"])
                record["job_hash"] = job["job_hash"]
                with open(results, "a") as f:
                    f.write(json.dumps(record) + "\n")
            print(f"done {prompt['id']} {run['key']}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python experiments/kvpress_side.py JOB.json")
    sys.exit(main(sys.argv[1]))
