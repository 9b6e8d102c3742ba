"""From the engine's cumulative token ids to what a client sees: text, stop strings, logprobs.

A `SampleDecoder` follows one sample. It detokenizes incrementally (text is released only
once it decodes to whole characters), ends the sample at the first stop string (the string
and what follows are cut; with vLLM's `include_stop_str_in_output` only what follows) or stop
token id (its text is left out), and holds back the last
`len(longest stop) - 1` characters while the sample runs, so streamed text never shows a
stop string that the final text cuts. Streaming and non-streaming responses are assembled
from the same deltas, so their texts are equal by construction.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from kvjax.engine.request import CompletionOutput, FinishReason

# OpenAI's finish reasons; an abort (client gone, server stopping) is vLLM's "abort".
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}


class IncrementalDetokenizer:
    """Text of a growing token sequence, one token at a time.

    Decodes a short window (from the last released boundary) rather than the whole
    sequence, and releases text only when it does not end in an incomplete character
    ("\\ufffd"), the approach of Hugging Face's text-generation-inference.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # the window's start
        self._read = 0  # tokens before this have been released

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (possibly '')."""
        self._ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read],
                                             skip_special_tokens=self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:],
                                      skip_special_tokens=self._skip)
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end), released."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read],
                                             skip_special_tokens=self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:],
                                      skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]


@dataclasses.dataclass
class SampleDelta:
    """What one update adds to a sample.

    Attributes:
      index: the sample's index in the request.
      text: newly released text.
      token_ids, logprobs: the new tokens kept (up to the one that completed a stop); an
        echoed prompt's first token has no logprob (None).
      top_logprobs: per new token {token id: logprob} (None for an echoed prompt's first
        token), or None when not asked for.
      text_offsets: where each new token's text starts in the sample's text.
      finish_reason: OpenAI's reason when the sample ended with this update, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None] | None
    text_offsets: list[int]
    finish_reason: str | None = None


class SampleDecoder:
    """One sample's text and tokens as the client sees them (see the module docstring).

    Attributes:
      index: the sample's index in its request.
      token_ids, logprobs: the tokens kept so far.
      text: the text so far (stop strings cut; held-back characters included).
      finish_reason: OpenAI's finish reason once done, else None.
    """

    def __init__(self, tokenizer, index: int, *, stop: list[str],
                 stop_token_ids: tuple[int, ...], text_offset: int = 0,
                 skip_special_tokens: bool = True, include_stop_str: bool = False):
        self.index = index
        self._text_offset = text_offset  # where the sample's text starts (after an echo)
        self._detokenizer = IncrementalDetokenizer(tokenizer,
                                                   skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop_str = include_stop_str
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._stop_token_ids = set(stop_token_ids)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self._released = 0
        self.finish_reason: str | None = None

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    def update(self, sample: CompletionOutput, top: list[dict[int, float]] | None,
               is_final: bool) -> SampleDelta | None:
        """Takes the sample's cumulative output; returns what it adds (None: nothing new)."""
        if self.is_done:
            return None
        start = len(self.token_ids)
        offsets = []
        for i in range(start, len(sample.token_ids)):
            token = sample.token_ids[i]
            self.token_ids.append(token)
            self.logprobs.append(sample.logprobs[i])
            offsets.append(self._text_offset + len(self.text))
            if token in self._stop_token_ids:
                self.finish_reason = "stop"  # The engine stops here too; no text for it.
                break
            if self._append(self._detokenizer.add(token)):
                break
        if not self.is_done and is_final:
            self._append(self._detokenizer.flush())
            if not self.is_done:
                self.finish_reason = FINISH_REASONS[sample.finish_reason or FinishReason.ABORT]
        end = len(self.text) if self.is_done else max(self._released,
                                                      len(self.text) - self._holdback)
        text, self._released = self.text[self._released:end], end
        new = slice(start, len(self.token_ids))
        if not text and new.start == new.stop and not self.is_done:
            return None
        return SampleDelta(
            index=self.index, text=text, token_ids=self.token_ids[new],
            logprobs=self.logprobs[new], top_logprobs=None if top is None else top[new],
            text_offsets=offsets, finish_reason=self.finish_reason)

    def _append(self, piece: str) -> bool:
        """Adds text; True when a stop string ended the sample (the text is cut there)."""
        if not piece:
            return False
        begin = max(0, len(self.text) - self._holdback)
        self.text += piece
        found = [(i, len(s)) for i, s in ((self.text.find(s, begin), s) for s in self._stop)
                 if i >= 0]
        if not found:
            return False
        at, length = min(found)
        self.text = self.text[:at + length if self._include_stop_str else at]
        self.finish_reason = "stop"
        return True


def echo_delta(tokenizer, index: int, prompt_ids: list[int], text: str | None,
               scored: list[tuple[float, dict[int, float]] | None] | None) -> SampleDelta:
    """The echoed prompt as a sample's first delta: its text (`text` as the client sent it,
    else the ids decoded), each token's offset in it, and with `scored`
    (`PrefillOnlyScorer.prompt_logprobs`) each token's logprob and top logprobs."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    offsets, decoded = [], ""
    for token in prompt_ids:
        offsets.append(len(decoded))
        decoded += detokenizer.add(token)
    decoded += detokenizer.flush()
    return SampleDelta(
        index=index, text=decoded if text is None else text, token_ids=list(prompt_ids),
        logprobs=[None if s is None else s[0] for s in scored] if scored else [],
        top_logprobs=[None if s is None else s[1] for s in scored] if scored else None,
        text_offsets=offsets)


def prompt_logprobs_entries(prompt_ids: Sequence[int],
                            scored: list[tuple[float, dict[int, float], int] | None],
                            spell: Callable[[int], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} over the top tokens there and the prompt's own token (`scored` from
    `PrefillOnlyScorer.prompt_logprobs`; `spell` gives a token's text)."""
    entries: list[dict | None] = []
    for token, score in zip(prompt_ids, scored, strict=True):
        if score is None:
            entries.append(None)
            continue
        logprob, top, rank = score
        entry = {str(t): dict(logprob=v, rank=i + 1, decoded_token=spell(t))
                 for i, (t, v) in enumerate(top.items())}
        entry[str(token)] = dict(logprob=logprob, rank=rank, decoded_token=spell(token))
        entries.append(entry)
    return entries


@functools.lru_cache(maxsize=8)
def token_strings(tokenizer) -> functools._lru_cache_wrapper:
    """A cached id -> text of that one token (special tokens spelled out) for `tokenizer`."""
    return functools.lru_cache(maxsize=65536)(
        lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
