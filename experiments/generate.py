"""`--experiment=generate`: answer one prompt, print it, optionally write DIR/results.jsonl."""
from __future__ import annotations

import time

from experiments import common
from mpcache_jax.generate import SamplingConfig, generate
from models import registry


def run(FLAGS) -> None:
    loaded = registry.load(FLAGS.model, weights_path=FLAGS.weights_path, cache_dir=FLAGS.cache_dir,
                           seed=FLAGS.seed, num_layers=FLAGS.num_layers)
    tok = loaded.tokenizer
    if tok is None:
        raise SystemExit(f"model {FLAGS.model!r} has no tokenizer (random weights); generate needs "
                         "one: use --model=smollm2-135m, or --model=gpt2 with --weights_path to a "
                         "directory holding tokenizer.json")
    if FLAGS.chat:
        prompt_ids = tok.encode_chat(FLAGS.prompt, system=FLAGS.system_prompt)
    else:
        prompt_ids = tok.encode(FLAGS.prompt)
    sampling = SamplingConfig(temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed)
    start = time.perf_counter()
    result = generate(loaded.model, loaded.params, prompt_ids, max_new_tokens=FLAGS.max_new_tokens,
                      sampling=sampling, stop_ids=tok.stop_ids, progress=True)
    elapsed = time.perf_counter() - start
    text = tok.decode(result.tokens)
    print(text)
    if FLAGS.output_dir:
        out = common.ensure_dir(FLAGS.output_dir)
        record = {
            "experiment": "generate", "model": FLAGS.model, "policy": "full",
            "prompt": FLAGS.prompt, "prompt_tokens": result.prompt_len, "tokens": result.tokens,
            "text": text, "stopped": result.stopped, "wall_s": round(elapsed, 3),
            "git_commit": common.git_commit(), "config": common.flag_values(FLAGS),
        }
        common.write_jsonl(out / "results.jsonl", [record])
        print(f"wrote {out / 'results.jsonl'}")
