"""`ChatTokenizer`: a BPE tokenizer plus (optional) chat template, built from GGUF metadata.

Only the `tokenizers` and `jinja2` packages are used (transformers' GGUF tokenizer path imports
torch). The GGUF metadata keys read are llama.cpp's:

  tokenizer.ggml.model        "gpt2": byte-level BPE (SmolLM2); "llama": SentencePiece (Gemma 3)
  tokenizer.ggml.tokens       vocabulary, in id order ("gpt2": spelled in the GPT-2 byte alphabet)
  tokenizer.ggml.merges       "gpt2": BPE merges "left right", highest priority first
  tokenizer.ggml.scores       "llama": per-token score (a higher score merges first)
  tokenizer.ggml.token_type   per-token type; 3 (CONTROL) marks special tokens like <|im_end|>,
                              4 (USER_DEFINED) tokens matched whole, 6 (BYTE) <0xXX> fallbacks
  tokenizer.ggml.{bos,eos,eot}_token_id, tokenizer.ggml.add_bos_token
  tokenizer.chat_template     a jinja2 template over `messages` (absent for a base model)

A SentencePiece vocabulary (tokenizer.ggml.model = "llama") becomes a `tokenizers` BPE with
byte fallback: spaces are written "▁" (no prefix space when tokenizer.ggml.add_space_prefix is
false), a merge joins two pieces whose concatenation is a normal token, and merges rank by that
token's score (ties: the longer left piece first). llama.cpp writes Gemma's whitespace-only
tokens with plain spaces; they are spelled with "▁" again.

    tok = ChatTokenizer.from_gguf(path)
    ids = tok.encode_chat("What is the capital of France?")
    text = tok.decode(generated_ids)

`save(directory)` / `ChatTokenizer.load(directory)` keep a parsed copy (tokenizer JSON + ids +
template) so a reload needs no GGUF parse.
"""
from __future__ import annotations

import json
import os
import pathlib

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

NORMAL_TOKEN_TYPE = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL
CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
USER_DEFINED_TOKEN_TYPE = 4
SPACE_MARK = "\u2581"  # SentencePiece's "▁"
END_OF_TURN_TOKEN = "<|im_end|>"
TOKENIZER_FILE = "tokenizer.json"
CHAT_FILE = "chat.json"


def _render_error(message: str):
    raise jinja2.exceptions.TemplateError(message)


class ChatTokenizer:
    """Text <-> token ids, and chat messages -> prompt text, for one vocabulary.

    Args:
      tokenizer: a `tokenizers.Tokenizer` with the control tokens registered as special tokens.
      chat_template: jinja2 source rendered with `messages` and `add_generation_prompt`; None
        for a base model without one (then only plain-text prompts: `encode_prompt`).
      bos_id, eos_id: ids from the metadata; eot_id: end-of-turn id if the metadata names one.
      add_bos: whether a prompt starts with BOS (tokenizer.ggml.add_bos_token; `encode_prompt`).
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, bos_id: int | None,
                 eos_id: int, eot_id: int | None = None, add_bos: bool = False):
        if add_bos and bos_id is None:
            raise ValueError("add_bos needs a BOS id (tokenizer.ggml.bos_token_id)")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_id = bos_id
        self._eos_id = eos_id
        self.eot_id = eot_id
        self.add_bos = bool(add_bos)
        self._template = None
        if chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _render_error
            self._template = env.from_string(chat_template)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, tokens: list[str], token_types: list[int], merges: list[str],
                      chat_template: str, bos_id: int | None, eos_id: int,
                      eot_id: int | None = None) -> "ChatTokenizer":
        """Byte-level BPE from the vocabulary (id order) and merges ("left right" strings).

        Pre-tokenization splits every digit on its own, then applies the GPT-2 byte-level split
        without a prefix space; decoding maps the byte alphabet back to UTF-8.
        """
        if len(tokens) != len(token_types):
            raise ValueError(f"{len(tokens)} tokens but {len(token_types)} token types in the metadata")
        vocab = {token: index for index, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("the vocabulary has duplicate tokens")
        merge_pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep or not left or not right:
                raise ValueError(f"malformed BPE merge {merge!r}: expected 'left right'")
            merge_pairs.append((left, right))
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tokenizer.decoder = decoders.ByteLevel()
        control = [token for token, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN_TYPE]
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                      for token in control])
        return cls(tokenizer, chat_template, bos_id, eos_id, eot_id)

    @classmethod
    def from_sentencepiece(cls, tokens: list[str], scores: list[float], token_types: list[int],
                           bos_id: int | None, eos_id: int, unk_id: int | None = None,
                           eot_id: int | None = None, add_bos: bool = False,
                           add_space_prefix: bool = False,
                           chat_template: str | None = None) -> "ChatTokenizer":
        """BPE with byte fallback from a SentencePiece vocabulary (ids in order, scores, types):
        see the module docstring for the merges."""
        if not len(tokens) == len(scores) == len(token_types):
            raise ValueError(f"{len(tokens)} tokens, {len(scores)} scores and {len(token_types)} "
                             "token types in the metadata")
        spelled = [SPACE_MARK * len(t) if t and not t.strip(" ") else t for t in tokens]
        vocab = {token: index for index, token in enumerate(spelled)}
        if len(vocab) != len(spelled):
            raise ValueError("the vocabulary has duplicate tokens")
        normal = [i for i, kind in enumerate(token_types) if kind == NORMAL_TOKEN_TYPE]
        rank = sorted(normal, key=lambda i: (-scores[i], i))
        merges = []
        for index in rank:
            token = spelled[index]
            splits = [(token[:cut], token[cut:]) for cut in range(len(token) - 1, 0, -1)]
            merges.extend(pair for pair in splits if pair[0] in vocab and pair[1] in vocab)
        unk = None if unk_id is None else spelled[unk_id]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                         byte_fallback=True))
        replace = normalizers.Replace(" ", SPACE_MARK)
        tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE_MARK), replace])
                                if add_space_prefix else replace)
        tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "),
                                               decoders.ByteFallback(), decoders.Fuse()])
        tokenizer.add_special_tokens([
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(spelled, token_types) if kind == CONTROL_TOKEN_TYPE])
        # User-defined tokens (newline runs, "▁▁" ...) are matched whole, in the text with its
        # spaces already written "▁" (SentencePiece matches them before merging).
        tokenizer.add_tokens([
            AddedToken(token, special=False, normalized=True)
            for token, kind in zip(spelled, token_types) if kind == USER_DEFINED_TOKEN_TYPE])
        return cls(tokenizer, chat_template, bos_id, eos_id, eot_id, add_bos)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "ChatTokenizer":
        """Read the tokenizer and chat template from a GGUF file's metadata."""
        import gguf

        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return cls.from_gguf_reader(gguf.GGUFReader(path))

    @classmethod
    def from_gguf_reader(cls, reader) -> "ChatTokenizer":
        """Like `from_gguf`, from an open `gguf.GGUFReader` (saves a second metadata parse)."""
        path = getattr(reader.data, "filename", "the GGUF file")

        def field(key: str, default=None, required: bool = False):
            entry = reader.fields.get(key)
            if entry is None:
                if required:
                    raise ValueError(f"{path} has no {key!r} metadata; cannot build its tokenizer")
                return default
            return entry.contents()

        model = field("tokenizer.ggml.model", required=True)
        if model == "llama":
            return cls.from_sentencepiece(
                tokens=field("tokenizer.ggml.tokens", required=True),
                scores=field("tokenizer.ggml.scores", required=True),
                token_types=field("tokenizer.ggml.token_type", required=True),
                bos_id=field("tokenizer.ggml.bos_token_id"),
                eos_id=field("tokenizer.ggml.eos_token_id", required=True),
                unk_id=field("tokenizer.ggml.unknown_token_id"),
                eot_id=field("tokenizer.ggml.eot_token_id"),
                add_bos=bool(field("tokenizer.ggml.add_bos_token", True)),
                add_space_prefix=bool(field("tokenizer.ggml.add_space_prefix", True)),
                chat_template=field("tokenizer.chat_template"))
        if model != "gpt2":
            raise ValueError(f"{path}: tokenizer.ggml.model={model!r}; only byte-level BPE "
                             "('gpt2') and SentencePiece ('llama') vocabularies are supported")
        tok = cls.from_metadata(
            tokens=field("tokenizer.ggml.tokens", required=True),
            token_types=field("tokenizer.ggml.token_type", required=True),
            merges=field("tokenizer.ggml.merges", required=True),
            chat_template=field("tokenizer.chat_template"),
            bos_id=field("tokenizer.ggml.bos_token_id"),
            eos_id=field("tokenizer.ggml.eos_token_id", required=True),
            eot_id=field("tokenizer.ggml.eot_token_id"),
        )
        tok.add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
        return tok

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> "ChatTokenizer | None":
        """The tokenizer of a Hugging Face checkpoint directory: tokenizer.json, with the chat
        template (chat_template.jinja, else tokenizer_config.json's chat_template), BOS / EOS
        tokens and add_bos_token of tokenizer_config.json; ids missing there are taken from
        generation_config.json / config.json (bos_token_id, eos_token_id; a second EOS id of
        generation_config.json becomes eot_id). When add_bos_token is not given, a prompt starts
        with BOS if tokenizer.json's own post-processor adds it. None without tokenizer.json."""
        directory = pathlib.Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises its own exception type
            raise ValueError(f"{path} is not a readable tokenizers file "
                             f"({' '.join(str(err).split())})") from err

        def read(name: str) -> dict:
            file = directory / name
            if not file.is_file():
                return {}
            try:
                value = json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{file} is not valid JSON ({' '.join(str(err).split())})") from err
            return value if isinstance(value, dict) else {}

        settings, generation = read("tokenizer_config.json"), read("generation_config.json")
        model_config = read("config.json")
        template_file = directory / "chat_template.jinja"
        template = (template_file.read_text() if template_file.is_file()
                    else settings.get("chat_template"))
        if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")

        def ids_of(name: str) -> list[int]:
            token = settings.get(f"{name}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                index = tokenizer.token_to_id(token)
                if index is None:
                    raise ValueError(f"{directory / 'tokenizer_config.json'}: {name}_token "
                                     f"{token!r} is not in {path}")
                return [index]
            for source in (generation, model_config):
                value = source.get(f"{name}_token_id")
                values = value if isinstance(value, list) else [value]
                if values and all(isinstance(v, int) for v in values):
                    return values
            return []

        bos, eos = ids_of("bos"), ids_of("eos")
        if not eos:
            raise ValueError(f"{directory}: no eos_token in tokenizer_config.json and no "
                             "eos_token_id in generation_config.json or config.json; generation "
                             "needs an end-of-sequence id")
        bos_id = bos[0] if bos else None
        stops = [i for i in generation.get("eos_token_id", []) if isinstance(i, int)] \
            if isinstance(generation.get("eos_token_id"), list) else []
        eot_id = next((i for i in stops if i != eos[0]), None)
        add_bos = settings.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_id is not None and \
                tokenizer.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(tokenizer, template, bos_id, eos[0], eot_id, bool(add_bos))

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and chat.json (template and special ids) into `directory`."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / TOKENIZER_FILE))
        chat = {"chat_template": self.chat_template, "bos_id": self.bos_id,
                "eos_id": self._eos_id, "eot_id": self.eot_id, "add_bos": self.add_bos}
        (directory / CHAT_FILE).write_text(json.dumps(chat, indent=1))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ChatTokenizer":
        """The tokenizer `save(directory)` wrote."""
        directory = pathlib.Path(directory)
        chat = json.loads((directory / CHAT_FILE).read_text())
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        return cls(tokenizer, chat["chat_template"], chat["bos_id"], chat["eos_id"], chat["eot_id"],
                   chat.get("add_bos", False))

    # ----- properties ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: <|im_end|> (if in the vocabulary), eos and eot."""
        ids = {self._eos_id}
        if self.eot_id is not None:
            ids.add(self.eot_id)
        end_of_turn = self.tokenizer.token_to_id(END_OF_TURN_TOKEN)
        if end_of_turn is not None:
            ids.add(end_of_turn)
        return tuple(sorted(ids))

    # ----- text ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to
        their ids. No BOS is added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's character span [start, end) in `text`."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(span) for span in encoding.offsets]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (no chat template): BOS first when the model's
        metadata asks for it (add_bos), then `encode(text)`."""
        return ([self.bos_id] if self.add_bos else []) + self.encode(text)

    def encode_request(self, text: str, chat: bool = True, system: str | None = None) -> list[int]:
        """A user's prompt: in the chat template when `chat` and the model has one
        (`encode_chat`), else plain text (`encode_prompt`; a base model without a template)."""
        if chat and self.has_chat_template:
            return self.encode_chat(text, system=system)
        return self.encode_prompt(text)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of `ids` (any int sequence); control tokens dropped when `skip_special`."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template (a base model): give "
                             "a plain-text prompt (--nochat)")
        for message in messages:
            if "role" not in message or "content" not in message:
                raise ValueError(f"each message needs 'role' and 'content', got {message!r}")
        special = self.tokenizer.id_to_token
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=special(self.bos_id) if self.bos_id is not None else "",
            eos_token=special(self._eos_id))

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        """Token ids of a one-turn chat prompt ending with the assistant's generation prompt."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": user_text})
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))
