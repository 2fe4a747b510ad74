"""`--model=PATH`: tiny random checkpoints written here in both formats load through the
registry and give transformers' logits.

GGUF files are written with the `gguf` package the way llama.cpp's converter writes them
(llama.cpp's tensor names, F32 tensors, the q/k row permutation of its `llama` architecture,
Gemma's norm weights stored as 1 + w); Hugging Face directories with `save_pretrained`
(safetensors). torch and transformers are test-time references only.
"""
from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from models import registry
from models.config import ConfigError

TOL = 1e-4
VOCAB = 259            # 256 byte-level tokens, "hi", <|im_start|>, <|im_end|>
PROMPT = 16
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
REPO = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("MPCACHE_CACHE_DIR") or
                     pathlib.Path.home() / ".cache" / "mpcache_jax").expanduser()


@pytest.fixture(scope="module")
def hf():
    """torch and transformers, with the model hub switched off."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        import torch
        import transformers
        yield types.SimpleNamespace(torch=torch, transformers=transformers)


# ----- tiny random reference models --------------------------------------------------------------
def _randomize(hf, model, seed: int = 0, zero_biases: bool = True, offset_norms: float = 1.0):
    """O(1) activations (the default init gives near-constant logits): norm weights
    offset + 0.2 noise, unit embeddings, kernels scaled by 1/sqrt(fan-in), biases zero."""
    torch = hf.torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(offset_norms + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(torch.zeros_like(p) if zero_biases else 0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[1]))
    return model.float().eval()


def _llama(hf, tie: bool, layers: int = 2, seed: int = 0):
    cfg = hf.transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
        intermediate_size=128, vocab_size=VOCAB, rope_theta=50000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, max_position_embeddings=192, bos_token_id=None,
        eos_token_id=VOCAB - 1, pad_token_id=None)
    return _randomize(hf, hf.transformers.LlamaForCausalLM(cfg), seed)


def _qwen2(hf, zero_biases: bool):
    cfg = hf.transformers.Qwen2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=128, vocab_size=VOCAB, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=160, use_sliding_window=False)
    return _randomize(hf, hf.transformers.Qwen2ForCausalLM(cfg), 1, zero_biases)


def _gemma3(hf):
    """Six layers (the sixth global, as llama.cpp's Gemma 3), window 5, local RoPE base 10000
    (llama.cpp's fixed value), query_pre_attn_scalar = head_dim (llama.cpp's scale)."""
    cfg = hf.transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-6, query_pre_attn_scalar=16, sliding_window=5,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        attn_implementation="eager")
    # Gemma's RMSNorm multiplies by 1 + weight: weights around 0.
    return _randomize(hf, hf.transformers.Gemma3ForCausalLM(cfg), 2, offset_norms=0.0)


def _tokens(n: int = PROMPT, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


def _max_dlogit(hf, loaded, reference, tokens) -> float:
    with hf.torch.no_grad():
        ref = reference(hf.torch.tensor(tokens[None].astype(np.int64))).logits[0].numpy()
    assert np.std(ref) > 0.5, "logits too flat for a meaningful comparison"
    ours = np.asarray(loaded.model.forward(loaded.params, tokens))
    return float(np.max(np.abs(ours.astype(np.float64) - ref)))


# ----- writing GGUF files as llama.cpp's converter does -----------------------------------------
def _byte_vocab() -> list[str]:
    from tokenizers import pre_tokenizers
    return sorted(pre_tokenizers.ByteLevel.alphabet()) + ["hi", "<|im_start|>", "<|im_end|>"]


def _to_llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: HF row c * d/2 + j of a head becomes row 2 * j + c."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


_LLAMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
                "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_tensors(reference, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's tensor names and layouts for a transformers model's state dict."""
    cfg = reference.config
    names = _GEMMA_NAMES if arch == "gemma3" else _LLAMA_NAMES
    state = {k: v.detach().float().numpy() for k, v in reference.state_dict().items()}
    norm = (lambda w: w + 1.0) if arch == "gemma3" else (lambda w: w)   # Gemma's 1 + w
    out = {"token_embd.weight": state.pop("model.embed_tokens.weight"),
           "output_norm.weight": norm(state.pop("model.norm.weight"))}
    lm_head = state.pop("lm_head.weight", None)
    if not cfg.tie_word_embeddings:
        out["output.weight"] = lm_head
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        _, _, index, rest = key.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        name = f"blk.{index}.{names[module]}.{kind}"
        if module.endswith("norm"):
            value = norm(value)
        elif arch == "llama" and module == "self_attn.q_proj":
            value = _to_llama_cpp_rows(value, cfg.num_attention_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            value = _to_llama_cpp_rows(value, cfg.num_key_value_heads)
        out[name] = value
    return out


def _gguf_metadata(reference, arch: str) -> dict:
    cfg = reference.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("full_attention", rope).get("rope_theta")
    meta = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads,
            "rope.freq_base": float(theta), "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps}
    if arch == "gemma3":
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                     "attention.sliding_window": cfg.sliding_window})
    return {f"{arch}.{k}": v for k, v in meta.items()}


def write_gguf(path, reference, arch: str = "llama", *, tokenizer: bool = True,
               drop: tuple[str, ...] = (), extra: dict | None = None,
               extra_tensors: dict | None = None, write_arch: str | None = None):
    """A GGUF of `reference` (F32 tensors). drop: metadata keys left out; extra: metadata
    added (int -> uint32, float -> float32, str -> string); write_arch: the architecture
    the file claims (general.architecture and the key prefix)."""
    import gguf

    claimed = write_arch or arch
    writer = gguf.GGUFWriter(str(path), claimed)
    meta = {k.replace(f"{arch}.", f"{claimed}.", 1): v
            for k, v in _gguf_metadata(reference, arch).items()}
    meta.update(extra or {})
    for key, value in meta.items():
        if key in drop:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    if tokenizer:
        vocab = _byte_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(vocab)
        writer.add_token_types([1] * (len(vocab) - 2) + [3, 3])
        writer.add_token_merges(["h i"])
        writer.add_eos_token_id(len(vocab) - 1)
        writer.add_chat_template(CHAT_TEMPLATE)
    tensors = _gguf_tensors(reference, arch)
    tensors.update(extra_tensors or {})
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(path)


# ----- Hugging Face directories ---------------------------------------------------------------
def write_tokenizer_files(directory: pathlib.Path) -> None:
    """tokenizer.json (byte-level BPE over the same vocabulary) + tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = _byte_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab[:-2])},
                               merges=[("h", "i")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab[-2:]])
    assert tok.token_to_id("<|im_end|>") == VOCAB - 1
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
         "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))


def save_hf(reference, directory: pathlib.Path, **kwargs) -> pathlib.Path:
    reference.save_pretrained(str(directory), **kwargs)
    return directory


# ----- GGUF: llama, qwen2, gemma3 -------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_gguf_matches_transformers(hf, tmp_path, tie):
    reference = _llama(hf, tie)
    path = write_gguf(tmp_path / "tiny-llama.gguf", reference)
    loaded = registry.load(str(path))
    cfg = loaded.model.cfg
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == \
        (2, 4, 2, 16, VOCAB)
    assert cfg.max_position == 192 and cfg.rope_theta == 50000.0 and cfg.norm_eps == 1e-5
    assert cfg.tie_embeddings == tie and cfg.name == "tiny-llama.gguf"
    err = _max_dlogit(hf, loaded, reference, _tokens())
    print(f"llama GGUF ({'tied' if tie else 'untied'}) vs transformers max |dlogit|: {err:.2e}")
    assert err <= TOL
    tok = loaded.tokenizer
    assert tok.encode("hi") == [256] and tok.decode(tok.encode("hi there")) == "hi there"
    assert tok.eos_id == VOCAB - 1 and tok.has_chat_template
    assert registry.get_config(str(path)) == cfg


def test_llama_gguf_keeps_the_first_layers(hf, tmp_path):
    reference = _llama(hf, tie=True, layers=3)
    path = write_gguf(tmp_path / "three.gguf", reference)
    assert registry.get_config(str(path), 2).num_layers == 2
    loaded = registry.load(str(path), num_layers=2)
    reference.model.layers = reference.model.layers[:2]
    reference.config.num_hidden_layers = 2
    err = _max_dlogit(hf, loaded, reference, _tokens(seed=1))
    print(f"llama GGUF first 2 of 3 layers vs transformers max |dlogit|: {err:.2e}")
    assert err <= TOL
    with pytest.raises(ConfigError, match=r"num_layers=4 must be in \[1, 3\] for .*three.gguf"):
        registry.get_config(str(path), 4)


def test_qwen2_gguf_with_zero_biases_matches_transformers(hf, tmp_path):
    reference = _qwen2(hf, zero_biases=True)
    path = write_gguf(tmp_path / "qwen2.gguf", reference, "qwen2")
    loaded = registry.load(str(path))
    assert loaded.model.cfg.rope_theta == 1e6 and loaded.model.cfg.max_position == 160
    err = _max_dlogit(hf, loaded, reference, _tokens(seed=2))
    print(f"qwen2 GGUF (zero biases) vs transformers max |dlogit|: {err:.2e}")
    assert err <= TOL


def test_qwen2_gguf_with_attention_biases_is_refused(hf, tmp_path):
    path = write_gguf(tmp_path / "qwen2-bias.gguf", _qwen2(hf, zero_biases=False), "qwen2")
    with pytest.raises(ValueError) as err:
        registry.get_config(str(path))
    message = str(err.value)
    assert "qwen2-bias.gguf" in message and "blk.0.attn_" in message and \
        "attention biases are not supported" in message and "\n" not in message


def test_gemma3_gguf_matches_transformers(hf, tmp_path):
    reference = _gemma3(hf)
    path = write_gguf(tmp_path / "gemma.gguf", reference, "gemma3", tokenizer=False)
    loaded = registry.load(str(path))
    cfg = loaded.model.cfg
    assert cfg.layer_types == ("local",) * 5 + ("global",) and cfg.sliding_window == 5
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 16.0)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.scale_embeddings
    assert cfg.activation == "gelu_tanh" and loaded.tokenizer is None
    err = _max_dlogit(hf, loaded, reference, _tokens(24, seed=3))   # the window of 5 slides
    print(f"gemma3 GGUF vs transformers max |dlogit|: {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("gguf_name, registered", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m"),
    ("gemma-3-270m-q4_k_m.gguf", "gemma3-270m")])
def test_the_registered_models_gguf_by_path_gives_their_registered_geometry(gguf_name, registered):
    path = CACHE / gguf_name
    if not path.is_file():
        pytest.skip(f"{path} is not cached (its registered model fetches it on first use)")
    assert registry.get_config(str(path)) == \
        registry.get_config(registered).replace(name=gguf_name)


# ----- Hugging Face directories ---------------------------------------------------------------
@pytest.mark.parametrize("form", ["tied", "untied", "bf16_sharded"])
def test_hf_directory_matches_transformers(hf, tmp_path, form):
    reference = _llama(hf, tie=form == "tied", seed=4)
    directory = tmp_path / "tiny-llama"
    if form == "bf16_sharded":
        with hf.torch.no_grad():   # the reference keeps exactly the bfloat16 values, in float32
            for p in reference.parameters():
                p.copy_(p.to(hf.torch.bfloat16).float())
        # a copy: casting the reference itself would round its RoPE frequencies too
        copy.deepcopy(reference).to(hf.torch.bfloat16).save_pretrained(
            str(directory), max_shard_size="40KB")
        assert (directory / "model.safetensors.index.json").is_file()
    else:
        save_hf(reference, directory)
    write_tokenizer_files(directory)
    loaded = registry.load(str(directory))
    cfg = loaded.model.cfg
    assert cfg.tie_embeddings == (form == "tied") and cfg.max_position == 192
    assert cfg.rope_theta == 50000.0 and cfg.name == "tiny-llama"
    err = _max_dlogit(hf, loaded, reference, _tokens(seed=5))
    print(f"HF directory ({form}) vs transformers max |dlogit|: {err:.2e}")
    assert err <= TOL


def test_hf_directory_keeps_the_first_layers(hf, tmp_path):
    reference = _llama(hf, tie=False, layers=3, seed=6)
    directory = save_hf(reference, tmp_path / "three")
    assert registry.get_config(str(directory), 1).num_layers == 1
    loaded = registry.load(str(directory), num_layers=1)
    assert loaded.tokenizer is None
    reference.model.layers = reference.model.layers[:1]
    reference.config.num_hidden_layers = 1
    err = _max_dlogit(hf, loaded, reference, _tokens(seed=7))
    print(f"HF directory first 1 of 3 layers vs transformers max |dlogit|: {err:.2e}")
    assert err <= TOL


def test_hf_tokenizer_matches_transformers(hf, tmp_path):
    directory = save_hf(_llama(hf, tie=True), tmp_path / "tok")
    write_tokenizer_files(directory)
    ours = registry.load(str(directory)).tokenizer
    theirs = hf.transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), eos_token="<|im_end|>")
    text = "hi there, 1234 héllo"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    assert ours.eos_id == VOCAB - 1 and ours.bos_id is None and not ours.add_bos
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=CHAT_TEMPLATE)


# ----- errors: one line naming the file and the field ---------------------------------------------
def _one_line_error(call, *fragments, kind=ValueError):
    with pytest.raises(kind) as err:
        call()
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.fixture(scope="module")
def small(hf):
    return _llama(hf, tie=True)


@pytest.mark.parametrize("changes, fragments", [
    (dict(write_arch="mamba"), ["general.architecture='mamba' is not supported",
                                "llama, qwen2, gemma3"]),
    (dict(drop=("llama.attention.layer_norm_rms_epsilon",)),
     ["has no 'llama.attention.layer_norm_rms_epsilon' metadata"]),
    (dict(drop=("llama.block_count",)), ["has no 'llama.block_count' metadata"]),
    (dict(extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
     ["llama.rope.scaling.type='linear'", "RoPE scaling is not supported"]),
    (dict(extra={"llama.rope.scaling.factor": 8.0}), ["llama.rope.scaling.factor=8.0"]),
    (dict(extra={"llama.rope.dimension_count": 8}), ["llama.rope.dimension_count=8"]),
    (dict(extra={"llama.expert_count": 8}), ["llama.expert_count=8", "mixture-of-experts"]),
    (dict(extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)}),
     ["'rope_freqs.weight'", "RoPE frequency factors"]),
    (dict(extra_tensors={"blk.0.attn_q.bias": np.full(64, 0.1, np.float32)}),
     ["'blk.0.attn_q.bias' is non-zero", "attention biases are not supported"]),
], ids=["architecture", "missing_eps", "missing_blocks", "rope_scaling", "rope_factor",
        "partial_rope", "experts", "rope_freqs", "llama_bias"])
def test_gguf_errors_name_the_file_and_the_field(small, tmp_path, changes, fragments):
    """Refused from the metadata alone (what get_config reads, before any work)."""
    path = write_gguf(tmp_path / "bad.gguf", small, **changes)
    _one_line_error(lambda: registry.get_config(str(path)), "bad.gguf", *fragments)


def test_gguf_whose_tensors_contradict_its_metadata_is_refused(small, tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", small, extra={"llama.feed_forward_length": 96})
    _one_line_error(lambda: registry.load(str(path)), "bad.gguf", "do not match",
                    "gate_proj/kernel")


def test_paths_that_are_not_checkpoints_are_one_line_errors(tmp_path):
    _one_line_error(lambda: registry.load(str(tmp_path / "missing.gguf")),
                    "model path not found", "missing.gguf", kind=FileNotFoundError)
    _one_line_error(lambda: registry.get_config(str(tmp_path)), str(tmp_path),
                    "has no config.json", kind=FileNotFoundError)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    _one_line_error(lambda: registry.load(str(text)), "notes.gguf", "is not a GGUF file")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    _one_line_error(lambda: registry.load(str(truncated)), "cut.gguf",
                    "is not a readable GGUF file")
    with pytest.raises(ConfigError, match="unknown model 'gpt5'.*or a path"):
        registry.get_config("gpt5")


@pytest.mark.parametrize("changes, fragments", [
    ({"model_type": "mistral"}, ["model_type='mistral' is not supported"]),
    ({"rms_norm_eps": None}, ["has no 'rms_norm_eps'"]),
    ({"hidden_size": None}, ["has no 'hidden_size'"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["rope_scaling=", "linear"]),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     ["rope_parameters.rope_type='llama3'"]),
    ({"attention_bias": True}, ["attention_bias=true"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
], ids=["model_type", "missing_eps", "missing_hidden", "rope_scaling", "rope_parameters",
        "attention_bias", "activation"])
def test_hf_config_errors_name_the_file_and_the_field(small, tmp_path, changes, fragments):
    directory = save_hf(small, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    _one_line_error(lambda: registry.get_config(str(directory)),
                    str(directory / "config.json"), *fragments)


def test_hf_directory_without_weights_or_with_extra_tensors(small, tmp_path):
    directory = save_hf(small, tmp_path / "ckpt")
    from safetensors.numpy import load_file, save_file
    state = load_file(str(directory / "model.safetensors"))
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)},
              str(directory / "model.safetensors"))
    _one_line_error(lambda: registry.load(str(directory)), "model.safetensors",
                    "'model.layers.0.self_attn.q_proj.bias'")
    (directory / "model.safetensors").unlink()
    _one_line_error(lambda: registry.load(str(directory)), str(directory),
                    "no *.safetensors", kind=FileNotFoundError)


# ----- the command line ---------------------------------------------------------------------------
def _run_cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "experiments.run", "--experiment=generate",
                           "--backend=xla", "--nocompile_cache", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_generates_from_a_gguf_path_and_refuses_a_missing_one(small, tmp_path):
    path = write_gguf(tmp_path / "chat.gguf", small)
    done = _run_cli(f"--model={path}", "--prompt=hi", "--max_new_tokens=3", "--policies=full")
    assert done.returncode == 0, done.stderr[-2000:]
    missing = _run_cli("--model=/nonexistent.gguf", "--prompt=hi")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "error: model path not found: /nonexistent.gguf (--model=PATH takes a .gguf file or a "
        "Hugging Face checkpoint directory holding config.json)")
