"""Flags of `mpcache run` (one definition, shared by every experiment)."""
from absl import flags

EXPERIMENTS = ("generate", "accuracy", "mpc_cost")

flags.DEFINE_enum("experiment", "generate", EXPERIMENTS, "Which experiment to run.")
# Model
flags.DEFINE_string("model", "smollm2-135m", "Registered model name (see models/registry.py).")
flags.DEFINE_string("weights_path", None, "Hugging Face-format weights directory (gpt2).")
flags.DEFINE_string("cache_dir", None,
                    "Where converted checkpoints live (default $MPCACHE_CACHE_DIR or ~/.cache/mpcache_jax).")
flags.DEFINE_integer("num_layers", None, "Keep only the first N layers (cost runs on reduced models).")
flags.DEFINE_list("layers", None, "mpc_cost: keep only these layers, e.g. 4,5,10,11 of "
                  "gemma3-270m (two local, two global); instead of --num_layers.")
flags.DEFINE_integer("seed", 0, "Seed for random weights and sampling.")
# Generation
flags.DEFINE_string("prompt", "What is the capital of France?", "User message (generate).")
flags.DEFINE_string("prompt_file", None, "Generate: read the user message from this file (long "
                    "prompts: a document and a question).")
flags.DEFINE_string("system_prompt", None, "Optional system message for the chat template.")
flags.DEFINE_bool("chat", True, "Wrap the prompt in the model's chat template when it has one.")
flags.DEFINE_integer("max_new_tokens", 64, "Maximum number of generated tokens.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (with temperature > 0).")
# Accuracy harness
flags.DEFINE_list("task", ["passkey"], "Accuracy task(s), comma-separated: passkey, needle, "
                  "kv_retrieval, ppl, longbench_jsonl, and the fidelity suite's multi_needle, "
                  "multi_hop, qa, continuation. Several tasks share one model load and one "
                  "compilation per policy.")
flags.DEFINE_list("policies", ["full", "mpcache"], "Registered policy names to evaluate.")
flags.DEFINE_string("variants", None,
                    'JSON {"label": {"policy": NAME, option: value, ...}} of configured variants '
                    "evaluated beside --policies (ablations).")
flags.DEFINE_list("budgets", ["0.05", "0.1", "0.2"],
                  "Budgets: ratios of the prompt in (0, 1], token counts (> 1), or a ratio with "
                  "a floor in tokens, RATIOminTOKENS (0.1min384: 10%, at least 384 tokens).")
flags.DEFINE_integer("num_samples", 20, "Samples per task.")
flags.DEFINE_list("lengths", ["1400"], "Prompt lengths in tokens (synthetic tasks, ppl prefix).")
flags.DEFINE_list("depths", ["0.1", "0.3", "0.5", "0.7", "0.9"], "Needle depths (fractions).")
flags.DEFINE_string("data_path", None, "Text file (ppl) or LongBench-format JSONL.")
flags.DEFINE_enum("metric", None, ["contains", "exact", "qa_f1", "rouge_l"],
                  "LongBench metric (default: by dataset name).")
flags.DEFINE_integer("ppl_target_len", 64, "Tokens scored after each ppl prefix.")
flags.DEFINE_list("buckets",
                  ["256", "384", "512", "768", "1024", "1536", "2048", "3072", "4096", "6144",
                   "8192", "12288", "16384", "24576", "32768"],
                  "Accuracy: prompts are padded to the first of these lengths that holds them "
                  "(their length a runtime value), so prefill, compression and decode compile "
                  "once per bucket and policy; empty (--buckets=) compiles per exact length. "
                  "The default's edges are the length classes (2^k, 3 x 2^(k-1)) by which the "
                  "default policy lays out a prompt: a bucket spanning two is skipped by it.")
flags.DEFINE_integer("agree_tokens", 16, "Accuracy: greedy agreement with the full cache and "
                     "the KL are measured over the first N generated tokens.")
flags.DEFINE_bool("mechanism", True, "Accuracy: per-layer answer-span survival after static "
                  "eviction and selection at the answer-writing step, for policies that "
                  "report them (MPCache and the prompt-eviction baselines).")
flags.DEFINE_bool("resume", False, "Accuracy: keep the per-sample records already in "
                  "OUTPUT_DIR/samples.jsonl (same flags) and run only the missing sample x policy "
                  "pairs, e.g. after a run was killed, or with a larger --num_samples, more "
                  "tasks, policies or budgets.")
flags.DEFINE_integer("batch_size", 0, "Accuracy: samples of one prompt shape decoded together "
                     "(0 = as many as --memory_budget_mb holds, at most 16).")
flags.DEFINE_integer("memory_budget_mb", 0, "Accuracy: device memory a batch may hold (0 = half "
                     "of the memory available at the start); sets the batch size.")
flags.DEFINE_integer("policy_chunk", 0, "Evaluate policies x budgets in groups of this many "
                     "programs, freeing compiled programs between groups (bounds memory on "
                     "large sweeps; each group prefills the samples again). 0: all at once.")
# Model numerics
flags.DEFINE_enum("activation_impl", "exact", ["exact", "poly", "newton"],
                  "MLP activation: exact (jax.nn), piecewise polynomial, or newton (sigmoid "
                  "from exp(-|x|) and Newton steps; SiLU / tanh-GeLU, the cheapest under MPC).")
# Secure inference (mpc_cost)
flags.DEFINE_enum("backend", "spu_sim", ["xla", "spu_sim", "spu_nodes"],
                  "xla = plaintext; spu_sim = SPU protocols with in-process parties; spu_nodes = "
                  "every party of --node_config as its own local process (loopback configs).")
flags.DEFINE_string("node_config", None,
                    "Node config JSON for --backend=spu_nodes (see experiments/nodes/*.json).")
flags.DEFINE_string("protocol", None,
                    "MPC protocol(s), comma-separated: ABY3 (3PC), SEMI2K (2PC), CHEETAH (2PC). "
                    "Overrides the protocol of --runtime_config.")
flags.DEFINE_string("runtime_config", None,
                    "SPU RuntimeConfig as a JSON file or text (field, fxp_fraction_bits, "
                    "fxp_exp_mode, ...), optionally wrapped as {runtime_config, parties}.")
flags.DEFINE_list("seq_lens", ["512", "1024", "2048"], "Cache lengths (prompt tokens) to cost.")
flags.DEFINE_string("mpc_bench", "decode",
                    "A benchmark registered in experiments.cost.BENCHMARKS (its docstring "
                    "lists them): decode (per-token decode cost per policy), gather (Table 2), "
                    "gather_dtype, repeat_noise, topk (lax vs rank), norm (one vs two rsqrt), rounds, "
                    "matmul (one secret matmul per shape), generate (secure greedy generation of "
                    "--prompt vs plaintext).")
flags.DEFINE_enum("topk_method", "auto", ["auto", "lax", "rank"],
                  "Top-k for policies that have one; auto = the cheaper one per protocol.")
flags.DEFINE_integer("mpc_share_from", None,
                     "Override MPCache's share_from (0 shows cross-layer sharing in 2-layer runs).")
flags.DEFINE_enum("softmax", "reciprocal", ["reciprocal", "divide"],
                  "Decode attention's softmax normalisation for every costed policy: reciprocal "
                  "(one 1/sum per row, multiplied in) or divide (element-wise, jax.nn.softmax's "
                  "form and the paper's SPU setting).")
flags.DEFINE_integer("mpc_repeats", 1,
                     "decode bench: run each policy's step program this many times and record "
                     "the run with the median compute (bytes and messages must not change; the "
                     "shared machine's timing noise does).")
flags.DEFINE_integer("mpc_decode_steps", 1,
                     "decode bench: decode steps run per policy (a generation from the prefilled "
                     "cache); records hold the per-step average, each step's own cost in "
                     "`steps` (a policy that refreshes its selection pays on some steps only).")
flags.DEFINE_bool("mpc_lm_head", True,
                  "decode bench: also cost the LM head + argmax once (the real vocabulary: on "
                  "Gemma 3's 262k entries the simulation peaks at ~20 GB of RAM); "
                  "--nompc_lm_head costs the layers only.")
flags.DEFINE_integer("no_cache_max_len", 512, "Longest cache length costed for no_cache.")
flags.DEFINE_integer("gather_tokens", 1024, "Table 2: tokens T.")
flags.DEFINE_integer("gather_clusters", 64, "Table 2: clusters C.")
flags.DEFINE_integer("gather_dim", 128, "Table 2: key dimension d.")
flags.DEFINE_integer("topk_rows", 32, "topk bench: rows (heads) ranked in one call.")
flags.DEFINE_list("topk_sizes", ["16", "32", "64", "128", "256"], "topk bench: candidates N.")
# Output
flags.DEFINE_string("output_dir", None, "Directory for results.jsonl (and plots, summaries).")
flags.DEFINE_bool("verbose", False, "Show the libraries' INFO logging (orbax, jax).")
flags.DEFINE_bool("compile_cache", True, "Keep compiled XLA programs in <cache_dir>/xla and "
                  "reuse them in later runs (JAX's persistent compilation cache); "
                  "--nocompile_cache compiles everything anew.")

FLAGS = flags.FLAGS

# Which flags each experiment reads. A flag given (on the command line or in a flagfile) to an
# experiment that does not read it is an error rather than a silently ignored setting that
# would still be recorded in the run's config. "nodes" is --backend=spu_nodes for
# accuracy/mpc_cost (the node config's job per --policies x --budgets x --seq_lens; each
# flag given overrides its job field: experiments/node_job.py).
COMMON_FLAGS = frozenset({"experiment", "model", "weights_path", "cache_dir", "num_layers",
                          "seed", "output_dir", "verbose", "activation_impl", "compile_cache"})
EXPERIMENT_FLAGS = {
    "generate": COMMON_FLAGS | {"backend", "policies", "budgets", "prompt", "prompt_file",
                                "system_prompt", "chat", "max_new_tokens", "temperature",
                                "top_p", "node_config", "protocol"},
    "accuracy": COMMON_FLAGS | {"task", "policies", "variants", "budgets", "num_samples",
                                "lengths", "depths", "data_path", "metric", "ppl_target_len",
                                "buckets", "agree_tokens", "mechanism", "resume",
                                "policy_chunk", "max_new_tokens", "batch_size",
                                "memory_budget_mb"},
    "mpc_cost": COMMON_FLAGS | {"layers", "backend", "policies", "variants", "budgets", "protocol",
                                "runtime_config", "seq_lens", "mpc_bench", "topk_method",
                                "mpc_share_from", "softmax", "no_cache_max_len", "mpc_repeats",
                                "mpc_decode_steps", "mpc_lm_head", "gather_tokens", "gather_clusters", "gather_dim", "topk_rows",
                                "topk_sizes", "prompt", "system_prompt", "chat",
                                "max_new_tokens"},
    "nodes": frozenset({"experiment", "backend", "node_config", "policies", "budgets",
                        "seq_lens", "max_new_tokens", "model", "num_layers", "seed",
                        "output_dir", "verbose", "compile_cache"}),
}
# --experiment=generate --backend=spu_nodes: the node config's job fixes the program (numerics,
# greedy decoding, no system message), so those flags would be ignored; the others given
# override the job's fields (experiments/node_job.py).
EXPERIMENT_FLAGS["generate_nodes"] = EXPERIMENT_FLAGS["generate"] - {
    "activation_impl", "temperature", "top_p", "system_prompt", "weights_path"}


def flags_not_used(experiment: str) -> list[str]:
    """Flags defined here that were given but that `experiment` (a key of EXPERIMENT_FLAGS)
    does not read."""
    import sys
    ours = [flag.name for flag in FLAGS.get_flags_for_module(sys.modules[__name__])]
    return sorted(name for name in ours
                  if FLAGS[name].present and name not in EXPERIMENT_FLAGS[experiment])
