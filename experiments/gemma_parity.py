"""Gemma 3 270M against transformers' Gemma3ForCausalLM: logits and greedy tokens.

    mpcache gemma-parity --lengths=16,512,4096 --new_tokens=32 [--reference=gguf]

For each prompt length T (natural prose from experiments/data/prose, after BOS): our prefill
logits at every prompt position for T <= 512, at the last one beyond ([T, 262144] floats take
gigabytes), our greedy continuation of `--new_tokens` tokens through the decode path (full cache in the global layers, ring buffers
in the local ones) and its decode-step logits, against the reference's forward over prompt +
continuation and its own greedy generation. Relative error = max |ours - reference| /
max |reference| over the compared logits. The reference is built from our converted
parameters (`--reference=params`, the tests' choice: seconds) or loaded by transformers from
the GGUF itself (`--reference=gguf`: its own dequantization and config reading, ~3 min).
torch and transformers are test-time references only (imported here, never by the runtime).
Results and the command that made them: docs/models.md.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time

import numpy as np
from absl import flags

from experiments import cli

PROSE = pathlib.Path(__file__).resolve().parent / "data" / "prose"
ALL_POSITIONS_UP_TO = 512   # longer prompts: the last position's prefill logits only


def prose_ids(tokenizer, length: int) -> list[int]:
    """BOS + the first length - 1 tokens of the prose files, concatenated in name order."""
    text = "\n\n".join(p.read_text() for p in sorted(PROSE.glob("*.txt")))
    ids = tokenizer.encode_prompt(text)
    if len(ids) < length:
        raise ValueError(f"the prose files hold {len(ids)} tokens, fewer than {length}")
    return ids[:length]


def hf_config(cfg):
    """transformers' Gemma3TextConfig for one of our Gemma-style ModelConfigs."""
    from transformers import Gemma3TextConfig

    kinds = {"global": "full_attention", "local": "sliding_attention"}
    return Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.norm_eps,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or cfg.head_dim),
        sliding_window=cfg.sliding_window or 4096,
        layer_types=[kinds[kind] for kind in cfg.layer_types],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": cfg.rope_local_theta or cfg.rope_theta}},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        attn_implementation="eager")


def hf_from_params(cfg, params):
    """Gemma3ForCausalLM (float32, eval mode) holding our parameters. Gemma's RMSNorm
    multiplies by 1 + weight; our scales (the GGUF's) are that factor, so weight = scale - 1."""
    import torch
    from transformers import Gemma3ForCausalLM

    from transformers.initialization import no_init_weights

    with no_init_weights():   # every weight is loaded below
        model = Gemma3ForCausalLM(hf_config(cfg)).float().eval()
    norms = {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "post_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    kernels = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
               "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
    t = lambda x: torch.from_numpy(np.array(x, np.float32))
    state = {"model.embed_tokens.weight": t(params["embed"]["embedding"]),
             "model.norm.weight": t(params["final_norm"]["scale"]) - 1.0}
    for i in range(cfg.num_layers):
        layer = params[f"layers_{i}"]
        for ours, theirs in norms.items():
            state[f"model.layers.{i}.{theirs}.weight"] = t(layer[ours]["scale"]) - 1.0
        for ours, theirs in kernels.items():
            state[f"model.layers.{i}.{theirs}.weight"] = t(layer[ours]["kernel"]).T.contiguous()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def hf_from_gguf(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def relative_error(ours, reference) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def compare(model, params, reference, prompt: list[int], new_tokens: int,
            tail: int | None = None, capacity: int | None = None) -> dict:
    """Our prefill + greedy decode against the reference's forward and greedy generation.

    tail: compare the last `tail` prompt positions only (None: all); capacity: cache slots
    (default prompt + new tokens; one capacity for several prompts compiles decode once).
    Returns the relative errors of the prefill and decode-step logits, both greedy
    continuations and timings."""
    import torch

    from runtime.generate import decode_tokens
    from mpcache_jax.policy import FULL

    T = len(prompt)
    start = time.perf_counter()
    cache = model.init_cache(capacity or T + new_tokens)
    if tail is None or tail >= T:
        prefill_logits, cache, _ = model.prefill(params, prompt, cache, all_logits=True)
        prefill_logits = np.asarray(prefill_logits)
        last, rows = prefill_logits[-1], slice(0, T)
    else:
        last, cache, _ = model.prefill(params, prompt, cache)
        prefill_logits, rows = np.asarray(last)[None], slice(T - 1, T)
    result = decode_tokens(model, params, last, cache, policy=FULL, start_pos=T,
                           max_new_tokens=new_tokens, keep_logits=True)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        ids = torch.tensor([prompt + result.tokens[:-1]])
        keep = T + new_tokens - 1 - rows.start
        ref = reference(ids, logits_to_keep=keep).logits[0].numpy()
        generated = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                       do_sample=False, min_new_tokens=new_tokens)
    ref_s = time.perf_counter() - start
    ref_prompt, ref_steps = ref[:T - rows.start], ref[T - rows.start - 1:]
    steps = np.stack(result.step_logits)
    return {
        "prompt_tokens": T, "compared_prompt_positions": T - rows.start,
        "prefill_rel_error": relative_error(prefill_logits, ref_prompt),
        "decode_rel_error": relative_error(steps, ref_steps),
        "max_abs_error": float(max(np.abs(prefill_logits - ref_prompt).max(),
                                   np.abs(steps - ref_steps).max())),
        "ours_tokens": result.tokens,
        "reference_tokens": generated[0, T:].tolist(),
        "ours_s": round(ours_s, 1), "reference_s": round(ref_s, 1),
    }


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("lengths", "16,512,4096", "comma-separated prompt lengths in tokens",
                        flag_values=fv)
    flags.DEFINE_integer("new_tokens", 32, "greedy tokens compared per length", flag_values=fv)
    flags.DEFINE_enum("reference", "params", ["params", "gguf"], "the reference's weights: our "
                      "params or the GGUF file", flag_values=fv)
    flags.DEFINE_string("cache_dir", None, "the model cache (default: the project's)",
                        flag_values=fv)
    flags.DEFINE_float("tolerance", 1e-3, "largest relative logits error that passes",
                       flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    args = _flags()
    cli.parse(args, argv, __doc__)
    missing = [name for name in ("torch", "transformers")
               if importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: {' and '.join(missing)} not installed: the references are test-only "
              "(requirements-dev.txt); add them with bash scripts/dev_requirements.sh (or "
              "pip install -e '.[dev]')", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from models import gemma3

    loaded = gemma3.load(cache_dir=args.cache_dir)
    start = time.perf_counter()
    if args.reference == "gguf":
        reference = hf_from_gguf(gemma3.fetch_gguf(args.cache_dir))
    else:
        reference = hf_from_params(loaded.model.cfg, loaded.params)
    print(f"reference ({args.reference}) ready in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    ok = True
    for length in (int(n) for n in args.lengths.split(",")):
        prompt = prose_ids(loaded.tokenizer, length)
        row = compare(loaded.model, loaded.params, reference, prompt, args.new_tokens,
                      tail=None if length <= ALL_POSITIONS_UP_TO else 1)
        row["same_tokens"] = row["ours_tokens"] == row["reference_tokens"]
        row["reference"] = args.reference
        ok &= (row["same_tokens"] and row["prefill_rel_error"] <= args.tolerance
               and row["decode_rel_error"] <= args.tolerance)
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("ours_tokens", "reference_tokens")}))
        print(f"  continuation: {loaded.tokenizer.decode(row['ours_tokens'])!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
