"""Text <-> token ids, and chat prompts, for the models kvjax loads.

A `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` built either from a `tokenizer.json` or
from the vocabulary a GGUF file stores as metadata (`tokenizer.ggml.*`). Encoding never adds
special tokens implicitly: `encode(text, add_bos=True)` is the only way a BOS gets in, so the ids a
request carries are exactly the ids its prompt spells.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

# GGUF token types (llama.cpp's `llama_token_type`): control tokens are special (skipped when
# decoding), user-defined ones are matched whole but decoded as text.
_GGUF_TOKEN_UNKNOWN = 2
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4
_GGUF_TOKEN_BYTE = 6
_SPM_SPACE = "\u2581"  # SentencePiece's visible space

# llama.cpp's `tokenizer.ggml.pre` names whose pre-tokenizer splits every digit on its own before
# the GPT-2 regex (SmolLM's and StarCoder's vocabularies were trained that way).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder")
# `tokenizer.ggml.pre` -> the regex splitting text before the byte-level mapping: contractions,
# letter runs, digits (Llama 3: in groups of up to three; Qwen2: one by one), punctuation runs,
# newlines and spaces.
_SPLIT_PRE = {
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
_SUPPORTED_GGUF_PRE = (*_DIGIT_SPLIT_PRE, "gpt-2", *_SPLIT_PRE)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level BPE tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + shifted)
            shifted += 1
    return spelling


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def _spm_merges(tokens: list[str], scores: list[float], merge_types: set[int],
                token_types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece tokenizer: a pair of adjacent pieces
    may merge when their concatenation is a token, the one of highest score first (ties: the
    earlier token, then the longer left piece)."""
    vocab = {t: i for i, t in enumerate(tokens) if token_types[i] in merge_types}
    ranked = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, -len(left), left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_backend(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int]
                 ) -> tuple[tokenizers.Tokenizer, list[str]]:
    """llama.cpp's SentencePiece tokenizer (`tokenizer.ggml.model == "llama"`): spaces become
    U+2581 (one prepended unless `tokenizer.ggml.add_space_prefix` is false), pieces merge by
    score over the whole text, and what no piece covers falls back to <0xXX> byte tokens.
    User-defined tokens keep their spelling (Gemma's runs of real spaces, tabs, newlines): added
    to the tokenizer, they match whole in the raw text first, as in llama.cpp.
    Returns it and the tokens as it spells them."""
    scores = list(metadata.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for "
                         f"{len(tokens)} tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens has duplicate tokens")
    unknown = [t for t, kind in zip(tokens, token_types, strict=True)
               if kind == _GGUF_TOKEN_UNKNOWN]
    merges = _spm_merges(tokens, scores, {1, _GGUF_TOKEN_USER_DEFINED}, token_types)
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token=unknown[0] if unknown else None,
        byte_fallback=True, fuse_unk=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace])
                          if prefix else replace)
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend, tokens


def _bpe_backend(metadata: Mapping[str, Any], tokens: list[str]
                 ) -> tuple[tokenizers.Tokenizer, list[str]]:
    """llama.cpp's byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and the tokens spelled in
    its byte alphabet."""
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _SUPPORTED_GGUF_PRE:
        raise ValueError(f"unsupported GGUF tokenizer.ggml.pre {pre!r}; "
                         f"supported: {list(_SUPPORTED_GGUF_PRE)}")
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError("GGUF metadata is missing tokenizer.ggml.merges")
    alphabet = _byte_level_alphabet()
    letters = set(alphabet.values())
    # A token outside the byte alphabet is stored as raw text; BPE needs its byte spelling.
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
               for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    if len(vocab) != len(spelled):
        raise ValueError("GGUF tokenizer.ggml.tokens has duplicate tokens")
    merges = []
    for merge in metadata["tokenizer.ggml.merges"]:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed GGUF merge {merge!r}")
        merges.append((left, right))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


class Tokenizer:
    """A byte-level BPE (or any `tokenizers`) tokenizer with the model's special tokens.

    Attributes:
      vocab_size: number of ids the tokenizer can produce (added tokens included).
      bos_token_id: the id `encode(..., add_bos=True)` prepends, or None.
      eos_token_ids: ids that end a generation.
      chat_template: the Jinja chat template stored with the model, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], chat_template: str | None = None):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        for token_id in (bos_token_id, *self.eos_token_ids):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"special token id {token_id} is outside the vocabulary "
                                 f"of size {self.vocab_size}")

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the vocabulary, merges and special tokens: part of the KV provenance."""
        digest = hashlib.blake2b(self._backend.to_str().encode(), digest_size=8)
        digest.update(repr((self.bos_token_id, self.eos_token_ids)).encode())
        return digest.hexdigest()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to (special tokens spelled out): with it, a
        text's length bounds its token count from below before it is tokenized."""
        ids = [[i] for i in range(self.vocab_size)]
        texts = self._backend.decode_batch(ids, skip_special_tokens=False)
        return max(map(len, texts), default=1)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (<|im_start|>) stay whole."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special_tokens=False`."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the model's template.

        Returns the prompt text; pass it to `encode` for ids. Rendering follows the conventions
        chat templates are written for (trim_blocks, lstrip_blocks, loop controls, `tojson`,
        `raise_exception`, `strftime_now`, the special tokens as `bos_token` / `eos_token`).
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda value, indent=None, ensure_ascii=False: json.dumps(
            value, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        bos = None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)
        eos = self._backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos, eos_token=eos)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Builds the tokenizer a GGUF file describes in its `tokenizer.*` metadata.

        Supports llama.cpp's byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the
        pre-tokenizers named by `tokenizer.ggml.pre` in ('smollm', 'starcoder', 'gpt-2',
        'llama-bpe', 'qwen2'), and its SentencePiece tokenizer (`"llama"`: Llama 2, Gemma),
        whose merges follow `tokenizer.ggml.scores`.

        Args:
          metadata: GGUF key -> decoded value (strings, ints, lists), e.g. from
            `kvjax.models.gguf.read_metadata`.
        """
        model_type = metadata.get("tokenizer.ggml.model")
        if model_type not in ("gpt2", "llama"):
            raise ValueError(f"unsupported GGUF tokenizer.ggml.model {model_type!r}; supported: "
                             "'gpt2' (byte-level BPE), 'llama' (SentencePiece)")
        if "tokenizer.ggml.tokens" not in metadata:
            raise ValueError("GGUF metadata is missing tokenizer.ggml.tokens")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        token_types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        if len(token_types) != len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.token_type has {len(token_types)} entries "
                             f"for {len(tokens)} tokens")
        if model_type == "gpt2":
            backend, spelled = _bpe_backend(metadata, tokens)
        else:
            backend, spelled = _spm_backend(metadata, tokens, token_types)
        backend.add_special_tokens([
            tokenizers.AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(spelled, token_types, strict=True)
            if kind == _GGUF_TOKEN_CONTROL])
        backend.add_tokens([
            tokenizers.AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(spelled, token_types, strict=True)
            if kind == _GGUF_TOKEN_USER_DEFINED])
        eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if k in metadata]
        return cls(backend, bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=list(dict.fromkeys(eos)),
                   chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike,
                  tokenizer_config: str | os.PathLike | None = None) -> Tokenizer:
        """Loads a `tokenizer.json`, with special tokens and chat template from its config.

        Args:
          tokenizer_json: path of a `tokenizers` serialization (`tokenizer.json`).
          tokenizer_config: optional `tokenizer_config.json` giving `bos_token`, `eos_token` and
            `chat_template`; a `chat_template.jinja` beside `tokenizer_json` is used when the
            config has no template.
        """
        tokenizer_json = Path(tokenizer_json)
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"no tokenizer file at {tokenizer_json}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        config: dict[str, Any] = {}
        if tokenizer_config is not None:
            config = json.loads(Path(tokenizer_config).read_text())
        ids = {}
        for role in ("bos_token", "eos_token"):
            token = _token_content(config.get(role))
            ids[role] = None if token is None else backend.token_to_id(token)
            if token is not None and ids[role] is None:
                raise ValueError(f"{role} {token!r} of {tokenizer_config} is not in the vocabulary")
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {entry["name"]: entry["template"] for entry in chat_template}
            if "default" not in named:
                raise ValueError(f"{tokenizer_config} has chat templates {sorted(named)} "
                                 "but none named 'default'")
            chat_template = named["default"]
        template_file = tokenizer_json.parent / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text()
        return cls(backend, bos_token_id=ids["bos_token"],
                   eos_token_ids=() if ids["eos_token"] is None else (ids["eos_token"],),
                   chat_template=chat_template)
