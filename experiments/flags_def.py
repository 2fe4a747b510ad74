"""Flags of `python -m experiments.run` (one definition, shared by every experiment)."""
from absl import flags

EXPERIMENTS = ("generate",)

flags.DEFINE_enum("experiment", "generate", EXPERIMENTS, "Which experiment to run.")
# Model
flags.DEFINE_string("model", "smollm2-135m", "Registered model name (see models/registry.py).")
flags.DEFINE_string("weights_path", None, "Hugging Face-format weights directory (gpt2).")
flags.DEFINE_string("cache_dir", None,
                    "Where converted checkpoints live (default $MPCACHE_CACHE_DIR or ~/.cache/mpcache_jax).")
flags.DEFINE_integer("num_layers", None, "Keep only the first N layers (cost runs on reduced models).")
flags.DEFINE_integer("seed", 0, "Seed for random weights and sampling.")
# Generation
flags.DEFINE_string("prompt", "What is the capital of France?", "User message (generate).")
flags.DEFINE_string("system_prompt", None, "Optional system message for the chat template.")
flags.DEFINE_bool("chat", True, "Wrap the prompt in the model's chat template when it has one.")
flags.DEFINE_integer("max_new_tokens", 64, "Maximum number of generated tokens.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (with temperature > 0).")
# Output
flags.DEFINE_string("output_dir", None, "Directory for results.jsonl (and plots, summaries).")

FLAGS = flags.FLAGS
