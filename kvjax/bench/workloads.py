"""Request workloads for the joint serving benchmark.

A workload is a list of `BenchRequest`s sorted by arrival time. Each generator has the form
`f(tokenizer, *, seed, num_requests, ...) -> list[BenchRequest]`, is deterministic per seed,
and is registered by name in `WORKLOADS`; `make_workload(name, tokenizer, **params)` builds
one from flag values. Prompts are corpus text (`kvjax.bench.corpus`) run through the
tokenizer and cut to the sampled length, so their token statistics are those of English.

The tokenizer is any object with `encode(text: str, add_bos: bool = False) -> list[int]`.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from kvjax.bench.corpus import make_needle_prompt, make_text
from kvjax.scheduler.context import Segment
from kvjax.scheduler.controller import SLO


class Tokenizer(Protocol):
    """What a workload needs from a tokenizer."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    Attributes:
        request_id: unique within the workload.
        arrival_time: seconds from the start of the run at which the request is submitted.
        prompt_ids: the prompt's token ids.
        max_new_tokens: how many tokens to generate (the benchmark ignores EOS so that every
            run generates the same number of tokens).
        tenant: who sent it (fairness, prefix-cache salts); None for a single tenant.
        n: samples per prompt (RL groups, best-of-n); they share the prompt's KV.
        priority: larger is more urgent, for schedulers that honour it.
        conversation_id: groups the turns of one conversation; None outside multi-turn.
        turn: 0-based turn index within the conversation.
        answer: the expected answer of a retrieval probe (needle prompts), else None.
        reuse_spans: [start, end) spans of prompt_ids that are reusable chunks (retrieved
            documents, `kvjax.Segment(reuse=True)`); () when the prompt has none.
        slo: its own SLO (TTFT, TPOT, KL budget); None: the run's.
    """

    request_id: str
    arrival_time: float
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    tenant: str | None = None
    n: int = 1
    priority: int = 0
    conversation_id: str | None = None
    turn: int = 0
    answer: str | None = None
    reuse_spans: tuple[tuple[int, int], ...] = ()
    slo: SLO | None = None

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        if not math.isfinite(self.arrival_time) or self.arrival_time < 0:
            raise ValueError(f"arrival_time must be finite and >= 0, got {self.arrival_time!r}")
        if not isinstance(self.prompt_ids, tuple) or not self.prompt_ids:
            raise ValueError(f"prompt_ids must be a non-empty tuple, got {self.prompt_ids!r:.80}")
        for name in ("max_new_tokens", "n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.turn < 0:
            raise ValueError(f"turn must be >= 0, got {self.turn!r}")
        for start, end in self.reuse_spans:
            if not 0 <= start < end <= len(self.prompt_ids):
                raise ValueError(f"reuse span [{start}, {end}) is outside the prompt of "
                                 f"{len(self.prompt_ids)} tokens")

    def segments(self) -> list[Segment]:
        """The prompt as `kvjax.Segment`s, its reuse spans marked reusable."""
        out, pos = [], 0
        for start, end in self.reuse_spans:
            if start > pos:
                out.append(Segment(self.prompt_ids[pos:start]))
            out.append(Segment(self.prompt_ids[start:end], reuse=True))
            pos = end
        if pos < len(self.prompt_ids):
            out.append(Segment(self.prompt_ids[pos:]))
        return out


class LengthDistribution(enum.Enum):
    """How prompt or output lengths are drawn."""

    FIXED = "fixed"  # always `length`
    UNIFORM = "uniform"  # integers uniform in [min_len, max_len]
    LOGNORMAL = "lognormal"  # exp(Normal(log(length), sigma)), rounded, clipped


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    """A length distribution clipped to [min_len, max_len].

    Attributes:
        dist: the distribution.
        length: the value for FIXED, the median for LOGNORMAL; unused by UNIFORM.
        sigma: standard deviation of log(length) for LOGNORMAL.
        min_len / max_len: inclusive bounds every sample is clipped to.
    """

    dist: LengthDistribution
    length: int
    sigma: float
    min_len: int
    max_len: int

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.dist is LengthDistribution.FIXED and not (
                self.min_len <= self.length <= self.max_len):
            raise ValueError(f"length {self.length} outside [{self.min_len}, {self.max_len}]")
        if self.dist is LengthDistribution.LOGNORMAL and self.length < 1:
            raise ValueError(f"the log-normal median must be >= 1, got {self.length}")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """`size` lengths, int64."""
        if self.dist is LengthDistribution.FIXED:
            return np.full(size, self.length, dtype=np.int64)
        if self.dist is LengthDistribution.UNIFORM:
            return rng.integers(self.min_len, self.max_len + 1, size=size)
        samples = np.exp(rng.normal(math.log(self.length), self.sigma, size=size))
        return np.clip(np.rint(samples), self.min_len, self.max_len).astype(np.int64)


# Chat-like defaults. The shape is the right-skewed, roughly log-normal length histogram that
# published chat traces show: ShareGPT as reported in the vLLM paper (Kwon et al., SOSP 2023:
# mean prompt ~161 tokens, mean output ~338) and the Azure LLM inference "conversation" trace
# in Splitwise (Patel et al., ISCA 2024: median prompt ~1020 tokens, median output ~129). The
# parameters are chosen to sit between those summaries, not fitted to raw trace data:
#   prompt: median 256, sigma 1.0 (mean ~422, p90 ~920), clipped to [8, 4096];
#   output: median 200, sigma 0.9 (mean ~300), clipped to [4, 1024].
CHAT_PROMPT_MEDIAN, CHAT_PROMPT_SIGMA, CHAT_PROMPT_MIN, CHAT_PROMPT_MAX = 256, 1.0, 8, 4096
CHAT_OUTPUT_MEDIAN, CHAT_OUTPUT_SIGMA, CHAT_OUTPUT_MIN, CHAT_OUTPUT_MAX = 200, 0.9, 4, 1024


def _length_spec(prefix: str, dist: str | LengthDistribution, length: int, sigma: float,
                 min_len: int, max_len: int) -> LengthSpec:
    if isinstance(dist, str):
        valid = [d.value for d in LengthDistribution]
        if dist not in valid:
            raise ValueError(f"{prefix}_dist must be one of {valid}, got {dist!r}")
        dist = LengthDistribution(dist)
    try:
        return LengthSpec(dist, length, sigma, min_len, max_len)
    except ValueError as e:
        raise ValueError(f"{prefix} lengths: {e}") from None


def _check_rate(name: str, rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"{name} must be > 0 (inf for all at t=0), got {rate!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _streams(seed: int, count: int) -> list[np.random.Generator]:
    """Independent generators, so changing one draw (e.g. lengths) leaves the others alone."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(count)]


def _poisson_arrivals(rng: np.random.Generator, rate: float, num: int) -> np.ndarray:
    """Arrival times of a Poisson process at `rate` per second; rate=inf puts all at 0."""
    if math.isinf(rate):
        return np.zeros(num)
    return np.cumsum(rng.exponential(1.0 / rate, size=num))


def _corpus_ids(tokenizer: Tokenizer, rng: np.random.Generator, num_tokens: int, *,
                add_bos: bool, lead: str = "") -> tuple[int, ...]:
    """Exactly `num_tokens` ids of `lead` then corpus text (BOS first when `add_bos`)."""
    ids: list[int] = []
    num_words, total_words = max(8, int(num_tokens * 0.8)), 0
    while len(ids) < num_tokens:
        text = (lead if not ids else "") + make_text(rng, num_words)
        chunk = tokenizer.encode(text, add_bos=add_bos and not ids)
        if not len(chunk):
            raise ValueError("tokenizer returned no ids for non-empty text")
        ids.extend(int(i) for i in chunk)
        total_words += num_words
        ids_per_word = len(ids) / total_words
        num_words = max(8, math.ceil((num_tokens - len(ids)) / ids_per_word * 1.1))
    return tuple(ids[:num_tokens])


def _sorted(requests: list[BenchRequest]) -> list[BenchRequest]:
    return sorted(requests, key=lambda r: r.arrival_time)


def poisson(tokenizer: Tokenizer, *, seed: int, num_requests: int, rate: float = 1.0,
            prompt_dist: str = "lognormal", prompt_len: int = CHAT_PROMPT_MEDIAN,
            prompt_sigma: float = CHAT_PROMPT_SIGMA, prompt_min: int = CHAT_PROMPT_MIN,
            prompt_max: int = CHAT_PROMPT_MAX, output_dist: str = "lognormal",
            output_len: int = CHAT_OUTPUT_MEDIAN, output_sigma: float = CHAT_OUTPUT_SIGMA,
            output_min: int = CHAT_OUTPUT_MIN, output_max: int = CHAT_OUTPUT_MAX,
            tenant: str | None = None) -> list[BenchRequest]:
    """Independent requests with Poisson arrivals at `rate` per second (inf: all at t=0).

    Prompt and output lengths follow `*_dist` ("fixed", "uniform", "lognormal"); `*_len` is
    the fixed value or the log-normal median, and every length is clipped to
    [`*_min`, `*_max`]. The defaults are the chat-like shape described above.
    """
    _check_positive("num_requests", num_requests)
    _check_rate("rate", rate)
    prompt_spec = _length_spec("prompt", prompt_dist, prompt_len, prompt_sigma, prompt_min,
                               prompt_max)
    output_spec = _length_spec("output", output_dist, output_len, output_sigma, output_min,
                               output_max)
    arrival_rng, length_rng, text_rng = _streams(seed, 3)
    arrivals = _poisson_arrivals(arrival_rng, rate, num_requests)
    prompt_lens = prompt_spec.sample(length_rng, num_requests)
    output_lens = output_spec.sample(length_rng, num_requests)
    return _sorted([
        BenchRequest(f"poisson-{i:05d}", float(arrivals[i]),
                     _corpus_ids(tokenizer, text_rng, int(prompt_lens[i]), add_bos=True),
                     int(output_lens[i]), tenant=tenant)
        for i in range(num_requests)
    ])


def shared_prefix(tokenizer: Tokenizer, *, seed: int, num_requests: int, rate: float = 1.0,
                  shared_fraction: float = 0.8, num_prefixes: int = 1, prefix_len: int = 1024,
                  question_min: int = 16, question_max: int = 128,
                  output_len: int = 128) -> list[BenchRequest]:
    """A long system prompt / few-shot block shared by a fraction of requests.

    Exactly `round(shared_fraction * num_requests)` requests (chosen at random) start with
    one of `num_prefixes` shared blocks of `prefix_len` tokens; the others start with a
    block of the same length of their own, so sharing is the only difference. Every request
    then has a question of `question_min`..`question_max` tokens that starts
    "Question <i>:", so no two questions are equal unless cut shorter than that label.
    """
    _check_positive("num_requests", num_requests)
    _check_positive("num_prefixes", num_prefixes)
    _check_positive("prefix_len", prefix_len)
    _check_positive("output_len", output_len)
    _check_rate("rate", rate)
    if not 0.0 <= shared_fraction <= 1.0:
        raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    question_spec = _length_spec("question", LengthDistribution.UNIFORM, question_min, 0.0,
                                 question_min, question_max)
    arrival_rng, choice_rng, text_rng = _streams(seed, 3)
    arrivals = _poisson_arrivals(arrival_rng, rate, num_requests)
    num_shared = round(shared_fraction * num_requests)
    is_shared = np.zeros(num_requests, dtype=bool)
    is_shared[choice_rng.permutation(num_requests)[:num_shared]] = True
    prefix_index = choice_rng.integers(num_prefixes, size=num_requests)
    question_lens = question_spec.sample(choice_rng, num_requests)
    prefixes = [_corpus_ids(tokenizer, text_rng, prefix_len, add_bos=True)
                for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        if is_shared[i]:
            prefix = prefixes[prefix_index[i]]
        else:
            prefix = _corpus_ids(tokenizer, text_rng, prefix_len, add_bos=True)
        question = _corpus_ids(tokenizer, text_rng, int(question_lens[i]), add_bos=False,
                               lead=f"Question {i + 1}: ")
        requests.append(BenchRequest(f"shared-{i:05d}", float(arrivals[i]), prefix + question,
                                     output_len))
    return _sorted(requests)


def multi_turn(tokenizer: Tokenizer, *, seed: int, num_requests: int, rate: float = 0.5,
               num_turns: int = 4, think_time_s: float = 5.0, user_min: int = 16,
               user_max: int = 128, answer_len: int = 128,
               max_prompt_len: int = 4096) -> list[BenchRequest]:
    """Conversations; each turn's prompt extends the previous turn's prompt.

    Conversations start as a Poisson process at `rate` per second. Turn k+1's prompt is turn
    k's prompt, then `answer_len` tokens of corpus text standing in for the assistant's
    answer (so the ids are known in advance; turn k asks for `answer_len` new tokens), then
    a new user message of `user_min`..`user_max` tokens. A conversation ends after
    `num_turns` turns or before its prompt would exceed `max_prompt_len`.

    Turn k+1 arrives an exponential think time (mean `think_time_s`) after turn k's arrival.
    A closed-loop driver holds turn k+1 until turn k has finished and then waits that gap.
    """
    for name, value in (("num_requests", num_requests), ("num_turns", num_turns),
                        ("answer_len", answer_len), ("max_prompt_len", max_prompt_len)):
        _check_positive(name, value)
    _check_rate("rate", rate)
    if not think_time_s >= 0:
        raise ValueError(f"think_time_s must be >= 0, got {think_time_s!r}")
    user_spec = _length_spec("user", LengthDistribution.UNIFORM, user_min, 0.0, user_min,
                             user_max)
    if user_max > max_prompt_len:
        raise ValueError(f"user_max {user_max} exceeds max_prompt_len {max_prompt_len}")
    arrival_rng, length_rng, text_rng = _streams(seed, 3)
    requests: list[BenchRequest] = []
    start = 0.0
    conversation = 0
    while len(requests) < num_requests:
        start += float(_poisson_arrivals(arrival_rng, rate, 1)[0])
        conversation_id = f"conv-{conversation:04d}"
        arrival, prompt = start, ()
        for turn in range(num_turns):
            user_len = int(user_spec.sample(length_rng, 1)[0])
            if turn > 0:
                answer = _corpus_ids(tokenizer, text_rng, answer_len, add_bos=False)
                if len(prompt) + answer_len + user_len > max_prompt_len:
                    break
                prompt = prompt + answer
                arrival += float(arrival_rng.exponential(think_time_s)) if think_time_s else 0.0
            prompt = prompt + _corpus_ids(tokenizer, text_rng, user_len, add_bos=turn == 0)
            requests.append(BenchRequest(f"{conversation_id}-turn-{turn}", arrival, prompt,
                                         answer_len, conversation_id=conversation_id,
                                         turn=turn))
            if len(requests) == num_requests:
                break
        conversation += 1
    return _sorted(requests)


_NEEDLE_KEYS = ("Project Falcon", "Vault Amber", "Locker Cobalt", "Archive Delta",
                "Station Ember", "Gate Fennel", "Cabinet Garnet", "Door Harbor")


def _fit_needle_prompt(tokenizer: Tokenizer, seed_seq: np.random.SeedSequence,
                       max_tokens: int, key: str, value: int,
                       position: float) -> tuple[tuple[int, ...], str]:
    """The needle prompt with the most whole filler sentences that fits in `max_tokens`.

    The filler for `w` words is a prefix of the filler for more words (the generator restarts
    from `seed_seq` each try), so the token count grows with `w` and a binary search applies.
    """
    def encode(filler_words: int) -> tuple[tuple[int, ...], str]:
        text, answer = make_needle_prompt(np.random.default_rng(seed_seq), filler_words, key,
                                          value, position)
        return tuple(int(i) for i in tokenizer.encode(text, add_bos=True)), answer

    num_bare = len(encode(0)[0])
    if num_bare > max_tokens:
        raise ValueError(f"a prompt length of {max_tokens} is too short for the needle and "
                         f"question ({num_bare} tokens)")
    low, high = 0, 16
    while len(encode(high)[0]) <= max_tokens:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if len(encode(middle)[0]) <= max_tokens:
            low = middle
        else:
            high = middle
    return encode(low)


def long_context(tokenizer: Tokenizer, *, seed: int, num_requests: int,
                 context_len: int = 4096, spread: float = 0.05, output_len: int = 64,
                 rate: float = math.inf, needle: bool = False,
                 needle_position: float | None = None) -> list[BenchRequest]:
    """Prompts of `context_len * (1 - spread)`..`context_len` tokens, optionally needle probes.

    With `needle`, each prompt plants "The secret code of <name> is <4 digits>." in filler
    text and asks for it at the end (`BenchRequest.answer` holds the digits). The needle sits
    at `needle_position` (a fraction of the filler), or, when None, at depths spread evenly
    over [0, 1] across the requests. A needle prompt is the longest whole-sentence filler
    that fits the sampled length, so it may fall short of it by up to one sentence.
    """
    _check_positive("num_requests", num_requests)
    _check_positive("context_len", context_len)
    _check_positive("output_len", output_len)
    _check_rate("rate", rate)
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    if needle_position is not None and not 0.0 <= needle_position <= 1.0:
        raise ValueError(f"needle_position must be in [0, 1], got {needle_position}")
    seed_seqs = np.random.SeedSequence(seed).spawn(4 + num_requests)
    arrival_rng, length_rng, text_rng, needle_rng = map(np.random.default_rng, seed_seqs[:4])
    filler_seeds = seed_seqs[4:]  # one per needle prompt, reused by every fitting attempt
    arrivals = _poisson_arrivals(arrival_rng, rate, num_requests)
    min_len = max(1, math.ceil(context_len * (1.0 - spread)))
    lengths = length_rng.integers(min_len, context_len + 1, size=num_requests)
    requests = []
    for i in range(num_requests):
        answer = None
        if needle:
            if needle_position is None:
                position = i / (num_requests - 1) if num_requests > 1 else 0.5
            else:
                position = needle_position
            key = (f"{_NEEDLE_KEYS[int(needle_rng.integers(len(_NEEDLE_KEYS)))]} "
                   f"{int(needle_rng.integers(100, 1000))}")
            value = int(needle_rng.integers(1000, 10000))
            prompt, answer = _fit_needle_prompt(tokenizer, filler_seeds[i], int(lengths[i]), key,
                                                value, position)
        else:
            prompt = _corpus_ids(tokenizer, text_rng, int(lengths[i]), add_bos=True)
        requests.append(BenchRequest(f"long-{i:05d}", float(arrivals[i]), prompt, output_len,
                                     answer=answer))
    return _sorted(requests)


RAG_SYSTEM = ("You answer questions from the documents below. Each document may state the "
              "secret code of someone.\n\n")


def rag(tokenizer: Tokenizer, *, seed: int, num_requests: int, rate: float = math.inf,
        num_docs: int = 24, docs_per_prompt: int = 3, doc_min_words: int = 80,
        doc_max_words: int = 160, popularity: float = 1.0, output_len: int = 8
        ) -> list[BenchRequest]:
    """Retrieval-augmented prompts: a system prompt, `docs_per_prompt` documents drawn from a
    pool of `num_docs`, and a question whose answer is a fact planted in one of them.

    Each document is corpus text with one fact "The secret code of <name> is <4 digits>."
    planted at a random sentence boundary; documents are tokenized on their own (so each has
    the same ids in every prompt) and marked reusable (`BenchRequest.reuse_spans`). Requests
    draw documents without repeats within a prompt, with Zipf-like weights rank^-popularity
    (0: uniform), in random order, so the same documents recur at different positions. The
    question asks for the code in one of the prompt's documents (`BenchRequest.answer`).
    """
    _check_positive("num_requests", num_requests)
    _check_positive("num_docs", num_docs)
    _check_positive("output_len", output_len)
    _check_rate("rate", rate)
    if not 0 < docs_per_prompt <= num_docs:
        raise ValueError(f"docs_per_prompt must be in [1, num_docs={num_docs}], got "
                         f"{docs_per_prompt}")
    if not 0 < doc_min_words <= doc_max_words:
        raise ValueError(f"need 0 < doc_min_words <= doc_max_words, got {doc_min_words}, "
                         f"{doc_max_words}")
    arrival_rng, doc_rng, choice_rng = _streams(seed, 3)
    arrivals = _poisson_arrivals(arrival_rng, rate, num_requests)
    docs = []
    for i in range(num_docs):
        key = (f"{_NEEDLE_KEYS[int(doc_rng.integers(len(_NEEDLE_KEYS)))]} "
               f"{int(doc_rng.integers(100, 1000))}")
        value = int(doc_rng.integers(1000, 10000))
        words = int(doc_rng.integers(doc_min_words, doc_max_words + 1))
        text, _ = make_needle_prompt(doc_rng, words, key, value, float(doc_rng.random()))
        body = text.split("\n\nQuestion:")[0]
        ids = tuple(int(t) for t in tokenizer.encode(f"Document {i + 1}: {body}\n\n"))
        docs.append((ids, key, str(value)))
    system = tuple(int(t) for t in tokenizer.encode(RAG_SYSTEM, add_bos=True))
    weights = np.arange(1, num_docs + 1, dtype=np.float64) ** -popularity
    weights /= weights.sum()
    requests = []
    for i in range(num_requests):
        chosen = choice_rng.choice(num_docs, size=docs_per_prompt, replace=False, p=weights)
        asked = docs[int(chosen[int(choice_rng.integers(docs_per_prompt))])]
        prompt, spans = list(system), []
        for d in chosen:
            spans.append((len(prompt), len(prompt) + len(docs[int(d)][0])))
            prompt.extend(docs[int(d)][0])
        prompt.extend(int(t) for t in tokenizer.encode(
            f"Question: What is the secret code of {asked[1]}? Answer: The secret code of "
            f"{asked[1]} is"))
        requests.append(BenchRequest(f"rag-{i:05d}", float(arrivals[i]), tuple(prompt),
                                     output_len, answer=asked[2], reuse_spans=tuple(spans)))
    return _sorted(requests)


def _burst_arrivals(rng: np.random.Generator, num: int, rates: np.ndarray, burst_tenant: int,
                    burst_multiplier: float, burst_start_s: float,
                    burst_end_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Superposed per-tenant Poisson processes whose burst tenant's rate changes in a window.

    The merged process is Poisson with the summed rate, piecewise constant in time; each
    arrival belongs to a tenant with probability proportional to that tenant's rate then.
    """
    times, tenants = np.empty(num), np.empty(num, dtype=np.int64)
    t = 0.0
    for i in range(num):
        while True:
            in_burst = burst_start_s <= t < burst_end_s
            current = rates.copy()
            if in_burst:
                current[burst_tenant] *= burst_multiplier
            boundary = burst_start_s if t < burst_start_s else (
                burst_end_s if in_burst else math.inf)
            gap = rng.exponential(1.0 / current.sum())
            if t + gap < boundary:
                break
            t = boundary  # memoryless: restart the wait at the rate change
        t += gap
        times[i] = t
        tenants[i] = rng.choice(len(current), p=current / current.sum())
    return times, tenants


def multi_tenant_burst(tokenizer: Tokenizer, *, seed: int, num_requests: int,
                       num_tenants: int = 4, base_rate: float = 1.0, burst_tenant: int = 0,
                       burst_multiplier: float = 10.0, burst_start_s: float = 0.0,
                       burst_duration_s: float = math.inf,
                       prompt_len: int = CHAT_PROMPT_MEDIAN,
                       output_len: int = CHAT_OUTPUT_MEDIAN, prompt_max: int = CHAT_PROMPT_MAX,
                       output_max: int = CHAT_OUTPUT_MAX,
                       system_prompt_len: int = 0) -> list[BenchRequest]:
    """Tenants "tenant-0".. each at `base_rate`; one floods at `burst_multiplier` times it.

    The flood lasts from `burst_start_s` for `burst_duration_s` (default: the whole run).
    Lengths are log-normal with the chat sigmas and clipping and medians `prompt_len` and
    `output_len`, at most `prompt_max` and `output_max`. With `system_prompt_len`, every
    prompt starts with its tenant's system prompt of that many tokens (one per tenant), and
    the log-normal length is what follows it.
    """
    _check_positive("num_requests", num_requests)
    _check_positive("num_tenants", num_tenants)
    for name, value in (("base_rate", base_rate), ("burst_multiplier", burst_multiplier)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    if not 0 <= burst_tenant < num_tenants:
        raise ValueError(f"burst_tenant must be in [0, {num_tenants}), got {burst_tenant}")
    if not (burst_start_s >= 0 and burst_duration_s > 0):
        raise ValueError(f"need burst_start_s >= 0 and burst_duration_s > 0, got "
                         f"{burst_start_s}, {burst_duration_s}")
    prompt_spec = _length_spec("prompt", LengthDistribution.LOGNORMAL, prompt_len,
                               CHAT_PROMPT_SIGMA, CHAT_PROMPT_MIN, prompt_max)
    output_spec = _length_spec("output", LengthDistribution.LOGNORMAL, output_len,
                               CHAT_OUTPUT_SIGMA, CHAT_OUTPUT_MIN, output_max)
    if not (isinstance(system_prompt_len, int) and system_prompt_len >= 0):
        raise ValueError(f"system_prompt_len must be an int >= 0, got {system_prompt_len!r}")
    arrival_rng, length_rng, text_rng, system_rng = _streams(seed, 4)
    times, tenants = _burst_arrivals(arrival_rng, num_requests, np.full(num_tenants, base_rate),
                                     burst_tenant, burst_multiplier, burst_start_s,
                                     burst_start_s + burst_duration_s)
    prompt_lens = prompt_spec.sample(length_rng, num_requests)
    output_lens = output_spec.sample(length_rng, num_requests)
    systems = [_corpus_ids(tokenizer, system_rng, system_prompt_len, add_bos=True)
               if system_prompt_len else () for _ in range(num_tenants)]
    return _sorted([
        BenchRequest(f"burst-{i:05d}", float(times[i]),
                     systems[tenants[i]] + _corpus_ids(tokenizer, text_rng, int(prompt_lens[i]),
                                                       add_bos=not system_prompt_len),
                     int(output_lens[i]), tenant=f"tenant-{tenants[i]}")
        for i in range(num_requests)
    ])


def tenant_flood(tokenizer: Tokenizer, *, seed: int, num_requests: int, rate: float = 1.0,
                 system_prompt_len: int = 256, question_len: int = 16, output_len: int = 16,
                 flood_share: float = 0.0, burst_size: int = 8, burst_interval_s: float = 4.0,
                 flood_prompt_len: int = 512, flood_output_len: int = 4
                 ) -> list[BenchRequest]:
    """A tenant reusing its system prompt while another floods the prefix cache.

    `round(flood_share * num_requests)` requests are tenant "flooder"'s: bursts of
    `burst_size` distinct prompts of `flood_prompt_len` tokens (no two share a page), one
    burst every `burst_interval_s` from time 0. The others are tenant "victim"'s, Poisson at
    `rate` per second: its system prompt of `system_prompt_len` tokens, then a distinct
    question. The victim's requests come from streams of their own, so a run without the
    flood (`flood_share=0` and the victim's count as `num_requests`) has the same ones.
    """
    for name, value in (("num_requests", num_requests), ("system_prompt_len", system_prompt_len),
                        ("question_len", question_len), ("output_len", output_len),
                        ("burst_size", burst_size), ("flood_prompt_len", flood_prompt_len),
                        ("flood_output_len", flood_output_len)):
        _check_positive(name, value)
    _check_rate("rate", rate)
    if not 0.0 <= flood_share < 1.0:
        raise ValueError(f"flood_share must be in [0, 1), got {flood_share!r}")
    if not burst_interval_s > 0:
        raise ValueError(f"burst_interval_s must be > 0, got {burst_interval_s!r}")
    num_flood = round(flood_share * num_requests)
    num_victim = num_requests - num_flood
    arrival_rng, victim_rng, flood_rng = _streams(seed, 3)
    arrivals = _poisson_arrivals(arrival_rng, rate, num_victim)
    system = _corpus_ids(tokenizer, victim_rng, system_prompt_len, add_bos=True)
    requests = [BenchRequest(
        f"victim-{i:05d}", float(arrivals[i]),
        system + _corpus_ids(tokenizer, victim_rng, question_len, add_bos=False,
                             lead=f"Question {i + 1}: "), output_len, tenant="victim")
        for i in range(num_victim)]
    requests += [BenchRequest(
        f"flood-{i // burst_size:03d}-{i % burst_size:03d}", i // burst_size * burst_interval_s,
        _corpus_ids(tokenizer, flood_rng, flood_prompt_len, add_bos=True), flood_output_len,
        tenant="flooder") for i in range(num_flood)]
    return _sorted(requests)


def rl_group(tokenizer: Tokenizer, *, seed: int, num_requests: int, group_size: int = 8,
             num_waves: int = 1, wave_interval_s: float = 0.0, prompt_min: int = 64,
             prompt_max: int = 512, output_len: int = 256) -> list[BenchRequest]:
    """RL rollout groups: `num_requests` prompts, each asking for `group_size` samples.

    Prompts are split into `num_waves` consecutive waves; wave k arrives at
    `k * wave_interval_s` (one wave: everything at t=0).
    """
    for name, value in (("num_requests", num_requests), ("group_size", group_size),
                        ("num_waves", num_waves), ("output_len", output_len)):
        _check_positive(name, value)
    if not wave_interval_s >= 0:
        raise ValueError(f"wave_interval_s must be >= 0, got {wave_interval_s!r}")
    prompt_spec = _length_spec("prompt", LengthDistribution.UNIFORM, prompt_min, 0.0,
                               prompt_min, prompt_max)
    length_rng, text_rng = _streams(seed, 2)
    prompt_lens = prompt_spec.sample(length_rng, num_requests)
    return [
        BenchRequest(f"rl-{i:05d}", float(i * num_waves // num_requests) * wave_interval_s,
                     _corpus_ids(tokenizer, text_rng, int(prompt_lens[i]), add_bos=True),
                     output_len, n=group_size)
        for i in range(num_requests)
    ]


_TRACE_FIELDS = {"arrival_time", "prompt_ids", "prompt_len", "output_len", "tenant", "n",
                 "priority", "request_id", "conversation_id", "turn"}


def _trace_field(entry: dict[str, Any], field: str, kind: str, where: str, *,
                 required: bool = False, minimum: float | None = None) -> Any:
    """One validated field of a trace line; `kind` is "finite number", "int" or "str"."""
    if field not in entry or entry[field] is None:
        if required:
            raise ValueError(f"{where}: missing required field {field!r}")
        return None
    value = entry[field]
    valid = {
        "finite number": isinstance(value, int | float) and not isinstance(value, bool)
        and math.isfinite(value),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not valid:
        raise ValueError(f"{where}: field {field!r} must be a {kind}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: field {field!r} must be >= {minimum}, got {value!r}")
    return value


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Parses and validates a JSONL trace (format: docs/trace_format.md).

    Returns one dict per non-blank line with keys `arrival_time`, `prompt_ids` (tuple or
    None), `prompt_len`, `output_len`, `tenant`, `n`, `priority`, `request_id`,
    `conversation_id`, `turn`, and `line` (1-based).

    Raises:
        ValueError: naming the file, the line number and the offending field.
    """
    entries = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(entry).__name__}")
            unknown = sorted(set(entry) - _TRACE_FIELDS)
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {unknown}; expected a subset of "
                                 f"{sorted(_TRACE_FIELDS)}")
            entries.append(_parse_trace_entry(entry, where, line_number))
    return entries


def _parse_trace_entry(entry: dict[str, Any], where: str, line_number: int) -> dict[str, Any]:
    prompt_ids = entry.get("prompt_ids")
    prompt_len = _trace_field(entry, "prompt_len", "int", where, minimum=1)
    if (prompt_ids is None) == (prompt_len is None):
        raise ValueError(f"{where}: give exactly one of 'prompt_ids' and 'prompt_len'")
    if prompt_ids is not None:
        if (not isinstance(prompt_ids, list) or not prompt_ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt_ids)):
            raise ValueError(f"{where}: field 'prompt_ids' must be a non-empty list of "
                             f"non-negative ints")
        prompt_ids = tuple(prompt_ids)
    return {
        "arrival_time": float(_trace_field(entry, "arrival_time", "finite number", where,
                                           required=True, minimum=0)),
        "prompt_ids": prompt_ids,
        "prompt_len": prompt_len,
        "output_len": _trace_field(entry, "output_len", "int", where, required=True, minimum=1),
        "tenant": _trace_field(entry, "tenant", "str", where),
        "n": _trace_field(entry, "n", "int", where, minimum=1) or 1,
        "priority": _trace_field(entry, "priority", "int", where) or 0,
        "request_id": _trace_field(entry, "request_id", "str", where),
        "conversation_id": _trace_field(entry, "conversation_id", "str", where),
        "turn": _trace_field(entry, "turn", "int", where, minimum=0) or 0,
        "line": line_number,
    }


def trace(tokenizer: Tokenizer, *, path: str | os.PathLike, seed: int = 0,
          num_requests: int | None = None, time_scale: float = 1.0) -> list[BenchRequest]:
    """Replays a JSONL trace (docs/trace_format.md).

    Lines with `prompt_len` get corpus text of that many tokens (deterministic per seed);
    lines with `prompt_ids` are used as they are. Arrival times are multiplied by
    `time_scale` (0.5 replays twice as fast). `num_requests` keeps the first that many lines.
    """
    if num_requests is not None:
        _check_positive("num_requests", num_requests)
    if not time_scale >= 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale!r}")
    entries = read_trace(path)[:num_requests]
    (text_rng,) = _streams(seed, 1)
    requests = []
    for entry in entries:
        prompt_ids = entry["prompt_ids"] or _corpus_ids(tokenizer, text_rng, entry["prompt_len"],
                                                        add_bos=True)
        requests.append(BenchRequest(
            entry["request_id"] or f"trace-{entry['line']:05d}",
            entry["arrival_time"] * time_scale, prompt_ids, entry["output_len"],
            tenant=entry["tenant"], n=entry["n"], priority=entry["priority"],
            conversation_id=entry["conversation_id"], turn=entry["turn"]))
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate request_id values")
    return _sorted(requests)


def write_trace(requests: Sequence[BenchRequest], path: str | os.PathLike) -> None:
    """Writes requests as a JSONL trace with `prompt_ids`, so `trace` replays them exactly."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            entry = {"request_id": r.request_id, "arrival_time": r.arrival_time,
                     "prompt_ids": list(r.prompt_ids), "output_len": r.max_new_tokens,
                     "tenant": r.tenant, "n": r.n, "priority": r.priority,
                     "conversation_id": r.conversation_id, "turn": r.turn}
            f.write(json.dumps({k: v for k, v in entry.items() if v is not None}) + "\n")


WORKLOADS: dict[str, Callable[..., list[BenchRequest]]] = {
    "poisson": poisson,
    "shared_prefix": shared_prefix,
    "multi_turn": multi_turn,
    "long_context": long_context,
    "multi_tenant_burst": multi_tenant_burst,
    "tenant_flood": tenant_flood,
    "rl_group": rl_group,
    "rag": rag,
    "trace": trace,
}


def make_workload(name: str, tokenizer: Tokenizer, **params: Any) -> list[BenchRequest]:
    """Builds the workload registered as `name` with keyword `params`.

    Raises:
        ValueError: for an unknown workload name, an unknown or missing parameter, or a
            parameter value the generator rejects.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)}")
    fn = WORKLOADS[name]
    signature = inspect.signature(fn).parameters
    accepted = {k for k, p in signature.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(f"workload {name!r} has no parameter(s) {unknown}; it accepts "
                         f"{sorted(accepted)}")
    missing = sorted(k for k in accepted if k not in params
                     and signature[k].default is inspect.Parameter.empty)
    if missing:
        raise ValueError(f"workload {name!r} needs parameter(s) {missing}")
    return fn(tokenizer, **params)
