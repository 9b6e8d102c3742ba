"""Structured outputs: grammars a request's tokens must follow, as per-row token bitmasks.

A request names a `Grammar` in its `SamplingParams` (a JSON schema, a regular expression, a
choice of strings or a Lark/GBNF grammar). The engine compiles it once against the model's
tokenizer (`GrammarCompiler`) and gives each of the request's sequences a `GrammarMatcher`,
host state that advances with every committed token. Before a row samples, its matcher's
`mask()` says which tokens may come next: an int32 word array, bit `t % 32` of word `t // 32`
set for an allowed token `t` (all bits set: unconstrained), which the jitted sampler applies
(`kvjax.sampling.apply_token_mask`).

The matching is done by llguidance, an optional extra (`pip install 'kvjax[grammar]'`):
without it a request with a grammar is refused with a ValueError that says so.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
from collections.abc import Sequence

import numpy as np

MAX_GRAMMAR_CHARS = 1 << 16
"""The longest grammar source a request may send (schemas of real APIs are a few KB)."""


# JSON without optional whitespace: a small model otherwise tends to spend its token budget on
# spaces and newlines between keys and never close the object.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: a JSON schema, as JSON text
    REGEX = "regex"  # source: a regular expression the whole output matches
    CHOICE = "choice"  # source: a JSON list of strings; the output is one of them
    LARK = "grammar"  # source: a Lark or GBNF (llama.cpp) context-free grammar


JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""`response_format: json_object`: any JSON object."""


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a request's output must match.

    Attributes:
      kind: how `source` is read (`GrammarKind`).
      source: the schema, regex, JSON list of choices or grammar text.
    """

    kind: GrammarKind
    source: str

    def __post_init__(self):
        if not isinstance(self.kind, GrammarKind):
            raise ValueError(f"grammar kind must be a GrammarKind, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"grammar {self.kind.value} must be a non-empty string, got "
                             f"{self.source!r}")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"grammar {self.kind.value} has {len(self.source)} characters, "
                             f"more than {MAX_GRAMMAR_CHARS}")

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """One of `options` (non-empty strings), exactly."""
        if isinstance(options, str) or not options or not all(
                isinstance(o, str) and o for o in options):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got "
                             f"{options!r}")
        return cls(GrammarKind.CHOICE, json.dumps(list(options)))


def mask_width(vocab_size: int) -> int:
    """Words of a token bitmask over `vocab_size` tokens: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def unconstrained_mask(vocab_size: int) -> np.ndarray:
    """[ceil(V / 32)] int32 with every bit set: every token allowed."""
    return np.full(mask_width(vocab_size), -1, np.int32)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need llguidance, an optional extra: "
                         "pip install 'kvjax[grammar]'") from None
    return llguidance


class GrammarMatcher:
    """One sequence's position in its grammar (host state, advanced token by token).

    Attributes:
      vocab_size: V, the tokens its masks cover.
    """

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def mask(self) -> np.ndarray:
        """[ceil(V / 32)] int32, the tokens allowed next (bit t % 32 of word t // 32)."""
        from llguidance.numpy import fill_next_token_bitmask

        words = np.zeros((1, mask_width(self.vocab_size)), np.int32)
        fill_next_token_bitmask(self._matcher, words)
        return words[0]

    def masks(self, drafts: Sequence[int]) -> np.ndarray:
        """[1 + len(drafts), ceil(V / 32)] int32: the mask before each draft token and after
        the last (what a verify step checks draft j and samples its own token against). The
        drafts are consumed on the matcher and rolled back; past a draft the grammar forbids,
        and past the draft that completes the output (the matcher stops there), masks are all
        zero (verification rejects that draft, or the output ends: none of them is read). A
        stopped matcher takes no more tokens, so only the drafts before the stop are rolled
        back (rolling back more would move it before the drafts)."""
        from llguidance.numpy import fill_next_token_bitmask

        words = np.zeros((1 + len(drafts), mask_width(self.vocab_size)), np.int32)
        fill_next_token_bitmask(self._matcher, words, 0)
        valid = self._matcher.validate_tokens([int(t) for t in drafts])
        consumed = 0
        while consumed < valid and not self._matcher.is_stopped():
            self._matcher.consume_token(int(drafts[consumed]))
            consumed += 1
            fill_next_token_bitmask(self._matcher, words, consumed)
        if consumed:
            self._matcher.rollback(consumed)
        return words

    def accept(self, token: int) -> None:
        """Advances past a committed token. A token the grammar forbids (the mask was built
        before it, so only a caller's bug produces one) stops the matcher."""
        self._matcher.consume_token(int(token))

    @property
    def is_finished(self) -> bool:
        """The output is complete (only EOS could follow) or no token can continue it."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (an n > 1 sample of a shared prompt)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size)


def pool_threads() -> int:
    """Threads `fill_masks` uses by default: 80% of the host's cores (llguidance's own default),
    at least one."""
    return max(1, (os.cpu_count() or 1) * 4 // 5)


@functools.cache
def _executor(num_threads: int):
    """llguidance's thread pool for batched mask fills (one per size, built on first use)."""
    return _llguidance().LLExecutor(num_threads=num_threads)


def fill_masks(rows: Sequence[tuple[GrammarMatcher, Sequence[int]]], *,
               num_threads: int | None = None) -> list[np.ndarray]:
    """`matcher.masks(drafts)` of several rows, computed together.

    With more than one row the masks are filled on llguidance's thread pool (by default only
    where it has more than one thread): rows without drafts in one call
    (`fill_next_token_bitmask_par`), rows with drafts in another
    (`fill_next_token_bitmask_par_with_draft_tokens`, which steps each matcher through its
    drafts and rolls it back as `masks` does; rows past a forbidden draft, or past the one that
    stops the matcher, stay all zero). Otherwise they are filled one after another on the
    calling thread: a pool of one thread only adds the hand-over (docs/benchmarks.md,
    "Structured outputs").

    Args:
      rows: (matcher, drafts) per constrained row; drafts may be empty. The matchers must be
        distinct objects (a fill advances and rolls back each one).
      num_threads: the pool's threads (the pool is used even with one); None:
        `pool_threads()`, and no pool when that is one.

    Returns:
      Per row, [1 + len(drafts), ceil(V / 32)] int32.
    """
    threads = pool_threads() if num_threads is None else num_threads
    if len(rows) <= 1 or (num_threads is None and threads <= 1):
        return [matcher.masks(drafts) for matcher, drafts in rows]
    from llguidance.numpy import (
        fill_next_token_bitmask_par,
        fill_next_token_bitmask_par_with_draft_tokens,
    )

    width = mask_width(rows[0][0].vocab_size)
    starts = np.cumsum([0] + [1 + len(drafts) for _, drafts in rows])  # [rows + 1]
    words = np.zeros((int(starts[-1]), width), np.int32)
    plain = [(m._matcher, int(start))
             for (m, drafts), start in zip(rows, starts, strict=False) if not drafts]
    drafted = [(m._matcher, int(start), [int(t) for t in drafts])
               for (m, drafts), start in zip(rows, starts, strict=False) if drafts]
    if plain:  # the library's draft variant refuses rows without drafts
        fill_next_token_bitmask_par(_executor(threads), plain, words)
    if drafted:
        fill_next_token_bitmask_par_with_draft_tokens(_executor(threads), drafted, words)
    return [words[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


class GrammarCompiler:
    """Compiles grammars against one model's tokenizer; matchers for its sequences.

    Building the grammar library's view of the vocabulary takes about a second on a 50k-token
    vocabulary, so it is done once, on the first grammar.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)

    @functools.cached_property
    def _lib_tokenizer(self):
        llg = _llguidance()
        return llg.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                               eos_token=self._eos_token_ids)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one compiler per engine, kept for its life)
    def compile(self, grammar: Grammar) -> str:
        """The library's compiled form of `grammar`; raises ValueError naming what is wrong
        (an unknown schema keyword, a regex syntax error, ...)."""
        llg = _llguidance()
        try:
            if grammar.kind is GrammarKind.CHOICE:
                Grammar.choice(json.loads(grammar.source))  # checks the list's shape
            if grammar.kind is GrammarKind.JSON_SCHEMA:
                text = llg.LLMatcher.grammar_from_json_schema(grammar.source,
                                                              defaults=_JSON_OPTIONS)
            else:
                text = llg.grammar_from(grammar.kind.value, grammar.source)
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"invalid {grammar.kind.value}: {_first_line(e)}") from None
        error = llg.LLMatcher.validate_grammar(text, self._lib_tokenizer)
        if error:
            raise ValueError(f"invalid {grammar.kind.value}: {_first_line(error)}")
        return text

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A matcher at the start of `grammar` (compiled once, then cached)."""
        llg = _llguidance()
        text = self.compile(grammar)
        return GrammarMatcher(llg.LLMatcher(self._lib_tokenizer, text), self.vocab_size)


def _first_line(error) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
