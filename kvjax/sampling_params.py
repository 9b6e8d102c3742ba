"""Sampling parameters: how a request picks its tokens, validated on the host.

Plain data with no jax: the scheduler, the router and a replay of recorded decisions use it
without a device. The jitted sampler that reads it is `kvjax.sampling`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from kvjax.grammar import Grammar

MAX_LOGIT_BIAS = 300
"""The most `logit_bias` entries a request may set (OpenAI's API has the same bound)."""


def _is_int(value) -> bool:
    """An int, numpy's included, but not a bool (True would pass as 1)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_real(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
      max_new_tokens: tokens to generate at most (> 0).
      temperature: 0 for greedy; otherwise logits are divided by it.
      top_k: keep the k most likely tokens (0: off).
      top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: off).
      seed: the request's random seed (None: derived from the request id by the engine).
      stop_token_ids: tokens that end the request (kept in the output), besides EOS.
      ignore_eos: keep generating past the model's EOS tokens.
      n: parallel samples of the same prompt (they share the prompt's KV pages).
      presence_penalty: in [-2, 2]; subtracted once from the logit of every token the output
        holds so far.
      frequency_penalty: in [-2, 2]; subtracted from a token's logit once per occurrence in
        the output so far.
      repetition_penalty: > 0 (1.0: off); a token of the prompt or the output has its logit
        divided by it when positive, multiplied by it when negative.
      logit_bias: token id -> bias in [-100, 100] added to its logit (a mapping, or pairs;
        ids may be decimal strings, as in JSON; stored as sorted (int, float) pairs; ids are
        checked against the vocabulary by the engine).
      min_p: in [0, 1]; drops tokens whose probability (after temperature) is below min_p
        times the most likely token's.
      min_tokens: EOS (unless ignored) and stop tokens are masked until this many tokens
        are generated (<= max_new_tokens).
      grammar: what the output must match (`kvjax.grammar.Grammar`: JSON schema, regex,
        choice, Lark/GBNF), or None; the request finishes (STOP) when the grammar is complete.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    grammar: Grammar | None = None

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(
                self.stop_token_ids, Sequence | np.ndarray):
            raise ValueError(f"stop_token_ids must be a sequence of int token ids, got "
                             f"{self.stop_token_ids!r}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be int token ids >= 0, got {bad[0]!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0, got "
                             f"{self.repetition_penalty!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_new_tokens="
                             f"{self.max_new_tokens}], got {self.min_tokens!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a kvjax Grammar, got {self.grammar!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    def stop_ids(self, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The sorted tokens that end a request: the model's EOS unless ignored, and its own
        stop tokens."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(sorted({*eos, *self.stop_token_ids}))

    @property
    def reads_history(self) -> bool:
        """Whether a penalty reads the tokens of the prompt or the output."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_rules(self) -> bool:
        """Whether the logits change before temperature (penalties, bias, min_tokens)."""
        return self.reads_history or bool(self.logit_bias) or self.min_tokens > 0


def _bias_pairs(logit_bias) -> tuple[tuple[int, float], ...]:
    """`logit_bias` (a mapping or pairs) as sorted (token id, bias) pairs; raises ValueError
    naming the entry that is not an id >= 0 with a bias in [-100, 100]."""
    if isinstance(logit_bias, Mapping):
        items = list(logit_bias.items())
    elif isinstance(logit_bias, str | bytes) or not isinstance(logit_bias, Sequence):
        raise ValueError(f"logit_bias must map token ids to biases, got {logit_bias!r}")
    else:
        items = list(logit_bias)
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got "
                         f"{len(items)}")
    pairs = {}
    for item in items:
        if not isinstance(item, Sequence) or isinstance(item, str | bytes) or len(item) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias), got {item!r}")
        token, bias = item
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)  # JSON objects (OpenAI's logit_bias) key ids by strings.
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias token ids must be ints >= 0, got {token!r}")
        if not _is_real(bias) or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias!r}")
        if int(token) in pairs:
            raise ValueError(f"logit_bias names token id {token} twice")
        pairs[int(token)] = float(bias)
    return tuple(sorted(pairs.items()))
