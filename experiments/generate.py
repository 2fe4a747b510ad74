"""`--experiment=generate`: answer one prompt, privately or in plaintext.

    --backend=spu_sim     the prompt stays secret-shared: prefill (with the policy's static
                          eviction) and every decode step run under MPC (SPU's simulator,
                          --protocol); the answer is checked against the plaintext run of the
                          same programs and the per-token cost is printed
    --backend=spu_nodes   the same, every party its own process (--node_config): the node
                          config's job decides every field no flag given overrides
                          (experiments/node_job.py); a prompt text goes to the prompt
                          owner's process only
    --backend=xla         plaintext chat

The prompt: --prompt (text), or --prompt_file (a long document and question), wrapped in the
model's chat template unless --nochat or the model has none (a base model such as gemma3-270m
gets the plain text, after BOS when its tokenizer asks for one). One policy (--policies;
without it `full`, no eviction) at one budget (--budgets: a ratio of the prompt, a token
count, or RATIOminTOKENS; without it the default's, `policies.DEFAULT_BUDGET`). Records:
DIR/results.jsonl (one per step + summary). The flags become a `GenerateConfig` once
(`from_flags`).
"""
from __future__ import annotations

import dataclasses
import pathlib
import resource
import sys
import time

import numpy as np

from experiments import common
from experiments.progress import GenerationProgress


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """What a generation reads, typed and checked once (`from_flags`).

    policy: (name, budget, constructed policy), budget None for `full`; prompt: the text
    (--prompt or the file's); template_flags: --chat / --system_prompt when given explicitly
    (an error for a model without a chat template); protocol: the one SPU protocol of a secure
    run; flag_values: every flag of the run (recorded with the plaintext answer)."""

    model: str
    policy: tuple
    prompt: str
    backend: str = "spu_sim"
    chat: bool = True
    system_prompt: str | None = None
    template_flags: tuple[str, ...] = ()
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    protocol: str = "ABY3"
    runtime_config: str | None = None
    output_dir: str | None = None
    weights_path: str | None = None
    cache_dir: str | None = None
    num_layers: int | None = None
    activation_impl: str = "exact"
    flag_values: dict = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def from_flags(cls, FLAGS) -> "GenerateConfig":
        protocols = (FLAGS.protocol or "ABY3").split(",")
        if FLAGS.backend != "xla" and len(protocols) != 1:
            raise ValueError(f"--experiment=generate runs one protocol; "
                             f"--protocol={FLAGS.protocol}")
        template_flags = tuple(f"--{name}" for name in ("chat", "system_prompt")
                               if FLAGS[name].present and getattr(FLAGS, name))
        return cls(model=FLAGS.model, policy=one_policy(FLAGS), prompt=read_prompt(FLAGS),
                   backend=FLAGS.backend, chat=FLAGS.chat, system_prompt=FLAGS.system_prompt,
                   template_flags=template_flags, max_new_tokens=FLAGS.max_new_tokens,
                   temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed,
                   protocol=protocols[0], runtime_config=FLAGS.runtime_config,
                   output_dir=FLAGS.output_dir, weights_path=FLAGS.weights_path,
                   cache_dir=FLAGS.cache_dir, num_layers=FLAGS.num_layers,
                   activation_impl=FLAGS.activation_impl,
                   flag_values=common.flag_values(FLAGS))


def read_prompt(FLAGS) -> str:
    if FLAGS.prompt_file:
        path = pathlib.Path(FLAGS.prompt_file)
        if not path.is_file():
            raise ValueError(f"--prompt_file={FLAGS.prompt_file!r} is not a readable file")
        return path.read_text()
    return FLAGS.prompt


def one_policy(FLAGS):
    """The single policy (and budget) a generation runs with."""
    from experiments.options import parse_budget
    from mpcache_jax.policies import DEFAULT_BUDGET, make_policy
    if not FLAGS["policies"].present:
        if FLAGS["budgets"].present:
            raise ValueError("--budgets needs --policies=NAME (without --policies, generate "
                             "keeps the whole cache: policy full)")
        return "full", None, make_policy("full")
    if len(FLAGS.policies) != 1:
        raise ValueError("--experiment=generate runs one policy: give --policies=NAME (e.g. "
                         "mpcache, or full for no eviction; full when --policies is absent)")
    name = FLAGS.policies[0]
    if name == "full":
        if FLAGS["budgets"].present:
            raise ValueError("--policies=full keeps the whole cache: drop --budgets (it would "
                             "be ignored)")
        return name, None, make_policy("full")
    if FLAGS["budgets"].present and len(FLAGS.budgets) != 1:
        raise ValueError(f"--experiment=generate runs one budget; --budgets={','.join(FLAGS.budgets)}")
    budget = parse_budget(FLAGS.budgets[0]) if FLAGS["budgets"].present else DEFAULT_BUDGET
    return name, budget, make_policy(name, budget)


def encode_prompt(cfg: GenerateConfig, tok) -> list[int]:
    """The prompt's ids: wrapped in the chat template when the model has one and --chat is on
    (the default); a base model without a template (gemma3-270m) gets the plain text, with
    BOS if its tokenizer asks for it. --chat given explicitly for such a model is an error."""
    if not tok.has_chat_template and cfg.template_flags:
        raise ValueError(f"{' and '.join(cfg.template_flags)}: {cfg.model} has no chat template "
                         "(a base model); drop them to give it a plain-text prompt")
    return tok.encode_request(cfg.prompt, chat=cfg.chat, system=cfg.system_prompt)


def check_prompt(policy, model, prompt_ids, max_new_tokens: int) -> None:
    """Clear errors before any secure work: context length and the policy's own limits."""
    T = len(prompt_ids)
    if T + max_new_tokens > model.cfg.max_position:
        raise ValueError(f"the prompt has {T} tokens; with --max_new_tokens={max_new_tokens} it "
                         f"exceeds {model.cfg.name}'s context of {model.cfg.max_position}: "
                         "shorten the prompt or generate fewer tokens")
    policy.check_prompt(T)


def run(FLAGS) -> None:
    if FLAGS.backend == "spu_nodes":
        # The node config's job decides what the flags given do not (experiments/node_job.py).
        from experiments import node_job
        return node_job.run(FLAGS)
    return generate_answer(GenerateConfig.from_flags(FLAGS))


def generate_answer(cfg: GenerateConfig) -> None:
    """One prompt answered on cfg.backend (xla: plaintext; spu_sim: private, checked against
    the plaintext run of the same programs)."""
    from models import registry
    name, budget, policy = cfg.policy
    loaded = common.with_model_numerics(
        registry.load(cfg.model, weights_path=cfg.weights_path, cache_dir=cfg.cache_dir,
                      seed=cfg.seed, num_layers=cfg.num_layers), cfg)
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer (random weights); generate needs "
                         "one: use --model=smollm2-135m, or --model=gpt2 with --weights_path to a "
                         "directory holding tokenizer.json")
    prompt_ids = encode_prompt(cfg, tok)
    check_prompt(policy, loaded.model, prompt_ids, cfg.max_new_tokens)
    if cfg.backend == "xla":
        return run_plaintext(cfg, loaded, prompt_ids, name, policy)
    return run_secure(cfg, loaded, prompt_ids, name, budget, policy)


def run_plaintext(cfg: GenerateConfig, loaded, prompt_ids, name, policy) -> None:
    from runtime.generate import SamplingConfig, generate
    tok = loaded.tokenizer
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    start = time.perf_counter()
    result = generate(loaded.model, loaded.params, prompt_ids, max_new_tokens=cfg.max_new_tokens,
                      policy=policy, sampling=sampling, stop_ids=tok.stop_ids, progress=True)
    elapsed = time.perf_counter() - start
    text = tok.decode(result.tokens)
    print(text)
    if cfg.output_dir:
        out = common.ensure_dir(cfg.output_dir)
        common.write_jsonl(out / "results.jsonl", [{
            "experiment": "generate", "backend": "xla", "model": cfg.model, "policy": name,
            "prompt_tokens": len(prompt_ids), "tokens": result.tokens, "text": text,
            "stopped": result.stopped, "wall_s": round(elapsed, 3),
            "git_commit": common.git_commit(), "config": cfg.flag_values}])
        print(f"wrote {out / 'results.jsonl'}")


def run_secure(cfg: GenerateConfig, loaded, prompt_ids, name, budget, policy) -> None:
    """Private generation in SPU's simulator, checked against the plaintext run."""
    from experiments.cost.harness import mpc_config
    from runtime import mpc
    from runtime.distributed.costs import generation_records
    from runtime.mpc.costs import cost_fields
    if cfg.temperature != 0.0:
        raise ValueError("private generation is greedy: drop --temperature (the sampled token "
                         "is the argmax, computed under MPC)")
    spu = mpc_config(cfg, cfg.protocol)
    tok, T = loaded.tokenizer, len(prompt_ids)
    print(f"private generation: {loaded.model.cfg.name}, {spu.protocol} ({spu.parties} parties, "
          f"SPU simulator), policy {name} (budget {budget}), prompt of {T} tokens")
    # The plaintext run of the same programs first (seconds): the secure answer is checked
    # against it, and its length is the number of tokens the progress bar expects (the secure
    # run stops at the same end-of-turn token unless fixed-point noise flips a near tie).
    print("plaintext run of the same programs (the reference for the check) ...",
          file=sys.stderr, flush=True)
    phase_start = time.perf_counter()
    plain = mpc.SecureSession(mpc.make_backend("xla"), loaded.model, loaded.params,
                              policy).generate(prompt_ids, cfg.max_new_tokens,
                                               stop_ids=tok.stop_ids, reveal_logits=True)
    print(f"plaintext run: {len(plain.tokens)} tokens in {time.perf_counter() - phase_start:.0f} "
          f"s; secret-sharing the weights among the {spu.parties} parties ...", file=sys.stderr,
          flush=True)
    phase_start = time.perf_counter()
    session = mpc.SecureSession(mpc.make_backend("spu_sim", spu), loaded.model, loaded.params,
                                policy)
    print(f"weights shared in {time.perf_counter() - phase_start:.0f} s", file=sys.stderr,
          flush=True)

    def describe_cost(step) -> str:
        """A step's measured cost, counted as the result records count it."""
        if step.cost is None:
            return ""
        fields = cost_fields(step.cost, step.wall_s, spu.parties)
        return f"{fields['comm_bytes'] / 1e9:.2f} GB, {fields['messages']:,} messages"

    progress = GenerationProgress(T, cfg.max_new_tokens, expected_tokens=len(plain.tokens),
                                  describe_cost=describe_cost, decode_text=tok.decode)
    start = time.perf_counter()
    try:
        result = session.generate(prompt_ids, cfg.max_new_tokens, stop_ids=tok.stop_ids,
                                  on_step=progress.step, on_phase=progress.phase)
    finally:
        progress.close()
    total_s = time.perf_counter() - start
    same = result.tokens == plain.tokens
    divergence = None if same else first_divergence(result.tokens, plain)
    records = generation_records(
        result, backend="spu_sim", policy=name, budget=budget, model=cfg.model,
        num_layers=cfg.num_layers, protocol=spu.protocol, parties=spu.parties, prompt_len=T,
        text=tok.decode(result.tokens), same_as_plaintext=same, plaintext_tokens=plain.tokens, divergence=divergence,
        total_s=round(total_s, 2), git_commit=common.git_commit())
    summary = records[-1]
    print(f"\nanswer: {summary['text']}")
    print(f"same tokens as the plaintext run: {'yes' if same else 'NO'}")
    if divergence is not None:
        print(f"  plaintext: {tok.decode(plain.tokens)}")
        print(f"  from generated token {divergence['step']} on: the plaintext run's choice "
              f"{tok.decode([divergence['plaintext_token']])!r} led the secure choice "
              f"{tok.decode([divergence['secure_token']])!r} by {divergence['margin']:.3f} "
              f"(plaintext logits, same context)"
              + (" - a near tie that fixed-point arithmetic can flip"
                 if divergence["near_tie"] else ""))
    prefill = records[0]
    print(f"prefill ({T} tokens): {prefill['comm_bytes'] / 1e6:.1f} MB, {prefill['messages']} "
          f"messages, {prefill['wall_s']:.1f} s")
    if "decode_comm_bytes_per_token" in summary:
        print(f"per generated token: {summary['decode_comm_bytes_per_token'] / 1e6:.1f} MB, "
              f"{summary['decode_messages_per_token']:.0f} messages, "
              f"{summary['decode_wall_s_per_token']:.2f} s (simulated parties on this machine; "
              f"modelled LAN time {summary['decode_lan_total_s_per_token']:.2f} s)")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # KiB on Linux
    summary["peak_rss_gb"] = round(peak_gb, 2)
    print(f"total {total_s:.0f} s including {result.compile_s:.0f} s compilation; peak memory "
          f"{peak_gb:.1f} GiB (this process: the simulated parties, the plaintext check)")
    if cfg.output_dir:
        out = common.ensure_dir(cfg.output_dir)
        common.write_jsonl(out / "results.jsonl", records)
        print(f"wrote {out / 'results.jsonl'}")
    if divergence is not None and not divergence["near_tie"]:
        raise SystemExit(1)


# Largest plaintext logit lead of the plaintext token over the secure one that still counts as
# a near tie: the fixed-point error of SmolLM2's logits under SPU (18 fraction bits, newton
# activation) reaches a few hundredths; 0.1 leaves a margin.
NEAR_TIE_LOGITS = 0.1


def first_divergence(secure_tokens, plain) -> dict:
    """Where the secure tokens leave the plaintext ones, and by how much the plaintext run
    preferred its own token there (same prefix, hence the same context)."""
    n = min(len(secure_tokens), len(plain.tokens))
    step = next((i for i in range(n) if secure_tokens[i] != plain.tokens[i]), n)
    if step == n:       # one run stopped earlier: no token to compare
        return {"step": step, "plaintext_token": None, "secure_token": None,
                "margin": float("nan"), "near_tie": False}
    logits = np.asarray(plain.logits[step], dtype=np.float64)
    margin = float(logits[plain.tokens[step]] - logits[secure_tokens[step]])
    return {"step": step, "plaintext_token": int(plain.tokens[step]),
            "secure_token": int(secure_tokens[step]), "margin": margin,
            "near_tie": margin <= NEAR_TIE_LOGITS}
