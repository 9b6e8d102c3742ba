"""Requests in: checking a request, building its sequences and queueing them.

`RequestIntake` is the engine's request API behind `Engine.validate_request`,
`Engine.add_request` and `Engine.grammar_matcher`: an invalid request fails alone with a
ValueError naming it and the value, and changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np

from kvjax import grammar as grammar_lib
from kvjax.config import KVLayout, ModelConfig
from kvjax.engine.config import EngineConfig
from kvjax.engine.request import Sequence
from kvjax.engine.runner import ModelRunner, rules_entries
from kvjax.kv.spec import KVCacheSpec
from kvjax.kv.state import pages_for
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.sampling import SamplingParams
from kvjax.scheduler.context import Segment, clip_spans, split_segments
from kvjax.scheduler.controller import SLO
from kvjax.scheduler.probes import probe_room
from kvjax.scheduler.scheduler import Scheduler
from kvjax.validation import check_identity, check_request_id

# Retention policies that evict whenever a sequence caches budget + P tokens, prefill included.
_ROLLING_EVICTION = ("streaming", "h2o", "tova")
# Bias entries per row of a step with rules (`StepShape.bias_width`): room for the most
# logit_bias entries a request may set and the stop tokens min_tokens masks.
BIAS_WIDTH = 512


def _segments(request_id: str, prompt) -> tuple[object, list[tuple[int, int]]]:
    """A prompt given as `Segment`s: its token ids and reusable spans; else (prompt, [])."""
    if not isinstance(prompt, Seq) or not any(isinstance(p, Segment) for p in prompt):
        return prompt, []
    if not all(isinstance(p, Segment) for p in prompt):
        raise ValueError(f"request {request_id!r}: a prompt of segments must hold only "
                         f"kvjax.Segment items")
    return split_segments(prompt)


def _token_ids(request_id: str, prompt_ids) -> list[int]:
    """The prompt as a list of Python ints; ValueError for anything but a flat sequence of
    ints (a float, string or bool would otherwise pass through int() as a token)."""
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Seq | np.ndarray):
        raise ValueError(f"request {request_id!r}: the prompt must be a sequence of int token "
                         f"ids, got {type(prompt_ids).__name__} {prompt_ids!r:.80}")
    for t in prompt_ids:
        if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer):
            raise ValueError(f"request {request_id!r}: token ids must be ints, got "
                             f"{type(t).__name__} {t!r:.80}")
    return [int(t) for t in prompt_ids]


class RequestIntake:
    """Checks requests and queues their sequences in the scheduler.

    Attributes:
      config: the engine's `EngineConfig`.
      model_config: the model's `ModelConfig` (vocabulary, EOS ids).
      tokenizer: the model's tokenizer (grammars need it), or None.
      scheduler, kv_cache, runner: the engine's parts requests go to and are checked against.
      kv_spec: the pool's `KVCacheSpec` (the pages a sequence holds).
      max_model_len: the context length, a whole number of pages.
      clock: seconds now (a request's arrival time when it gives none).
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer, *,
                 scheduler: Scheduler, kv_cache: KVCacheManager, runner: ModelRunner,
                 kv_spec: KVCacheSpec, max_model_len: int, clock: Callable[[], float]):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.runner = runner
        self.kv_spec = kv_spec
        self.max_model_len = max_model_len
        self.clock = clock
        self._grammars: grammar_lib.GrammarCompiler | None = None  # built on the first grammar

    def validate_request(self, request_id: str, prompt_ids: Seq[int],
                         sampling: SamplingParams) -> list[int]:
        """Checks a request; raises ValueError naming the problem. Returns its token ids (of
        a prompt of `Segment`s, their concatenation)."""
        check_request_id(request_id)
        prompt_ids, _ = _segments(request_id, prompt_ids)
        self.runner.kv.check_ready()  # A calibrated fp8 pool needs its scales first.
        if self.scheduler.has_request(request_id):
            raise ValueError(f"duplicate request_id {request_id!r}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        prompt = _token_ids(request_id, prompt_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        bad = [t for t in sampling.stop_token_ids if not t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: stop token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        bad = [t for t, _ in sampling.logit_bias if not t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: logit_bias token id {bad[0]} is outside "
                             f"the vocabulary [0, {vocab})")
        entries = rules_entries(sampling, sampling.stop_ids(self.model_config.eos_token_ids))
        if entries > BIAS_WIDTH:
            raise ValueError(f"request {request_id!r}: logit_bias and the stop tokens "
                             f"min_tokens masks take {entries} entries, more than {BIAS_WIDTH}")
        if sampling.grammar is not None:
            self.grammar_matcher(request_id, sampling.grammar)
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens does not "
                             f"fit the context length {self.max_model_len} (at least one token "
                             f"must be generated)")
        need = self._max_pages_held(min(len(prompt) + sampling.max_new_tokens,
                                        self.max_model_len))
        need = max(need, self._max_pages_held(len(prompt) + self._longest_probe(request_id,
                                                                                prompt)))
        if self.config.kv_layout is KVLayout.PAGED and need * sampling.n > self.kv_cache.num_pages:
            raise ValueError(f"request {request_id!r} needs {need * sampling.n} KV pages but "
                             f"the pool has {self.kv_cache.num_pages}")
        return prompt

    def _longest_probe(self, request_id: str, prompt: list[int]) -> int:
        """The most tokens a probe row of the retention policy holds after `prompt`
        (`RetentionPolicy.probes`); ValueError when one must run and cannot fit the context."""
        policy = self.kv_cache.retention.policy
        if not policy.probes_first:
            return 0
        cfg = self.config
        room = probe_room(len(prompt), max_model_len=self.max_model_len,
                          max_prefill_chunk=cfg.max_prefill_chunk,
                          max_num_batched_tokens=cfg.max_num_batched_tokens)
        probes = policy.probes(prompt, room)
        if not probes and policy.budget is not None and len(prompt) > policy.budget:
            raise ValueError(f"request {request_id!r}: retention {policy.name!r} runs probe "
                             f"rows of at most {room} tokens after its {len(prompt)} prompt "
                             f"tokens (the context length {self.max_model_len}, the step's "
                             f"token budget and prefill chunk), no room for one")
        return max((len(p.token_ids) for p in probes), default=0)

    def add_request(self, request_id: str, prompt_ids: Seq[int] | Seq[Segment],
                    sampling: SamplingParams | None = None, *, tenant: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    context_reuse: str | None = None, slo: SLO | None = None,
                    cache_salt: str | None = None) -> None:
        """Queues a request. Invalid requests raise ValueError and change nothing.

        tenant: who sent it: its prefix-cache pages are its own, and fair admission and
          eviction count by it. cache_salt (vLLM's field): the request's pages are cached
          under this salt instead, shared by every request naming it whichever its tenant
          (`EngineConfig.hide_shared_prefix_hits` hides from each tenant the hits others
          paid for).

        slo: its TTFT / TPOT targets and KL budget (`kvjax.scheduler.controller.SLO`), which
          the engine's KV controller serves; None: EngineConfig.slo.

        prompt_ids: token ids, or `Segment`s whose reusable ones take their KV from the chunk
          cache (`kvjax.scheduler.context`) under `context_reuse` (a strategy name; None:
          EngineConfig.context_reuse). A strategy other than the configured one compiles its
          programs on first use.
        """
        sampling = sampling or SamplingParams()
        check_identity(request_id, tenant=tenant, priority=priority, arrival_time=arrival_time,
                       cache_salt=cache_salt)
        prompt = self.validate_request(request_id, prompt_ids, sampling)
        _, spans = _segments(request_id, prompt_ids)
        reuse = self.config.context_reuse if context_reuse is None else context_reuse
        try:
            strategy = self.scheduler.strategy(reuse)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        if spans and strategy.reuses and not self.kv_cache.has_prefix_cache:
            raise ValueError(f"request {request_id!r}: context_reuse={reuse!r} keeps chunks in "
                             f"the prefix cache, which this engine has off")
        if slo is not None and not isinstance(slo, SLO):
            raise ValueError(f"request {request_id!r}: slo must be a kvjax SLO, got {slo!r}")
        arrival = self.clock() if arrival_time is None else arrival_time
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(
            hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")
        common = dict(request_id=request_id, num_prompt_tokens=len(prompt), sampling=sampling,
                      arrival_time=arrival, order=self.scheduler.next_order(), tenant=tenant,
                      priority=priority, context_reuse=reuse, slo=slo or self.config.slo)
        if sampling.n > 1 and len(prompt) > 1:
            # The samples share the prompt: prefill all but its last token once, then fork.
            seqs = [Sequence(seq_id=f"{request_id}#prompt", tokens=prompt[:-1], seed=seed,
                             is_group_prefill=True,
                             chunk_spans=clip_spans(spans, len(prompt) - 1), **common)]
        else:
            seqs = [Sequence(seq_id=f"{request_id}#{i}", tokens=list(prompt), seed=seed + i,
                             sample_index=i, chunk_spans=clip_spans(spans, len(prompt)),
                             **common) for i in range(sampling.n)]
        if sampling.grammar is not None:
            for seq in seqs:
                seq.grammar = self.grammar_matcher(request_id, sampling.grammar)
        self.scheduler.add_request(request_id, prompt, seqs, arrival=arrival, tenant=tenant,
                                   n=sampling.n, cache_salt=cache_salt)

    def grammar_matcher(self, request_id: str, grammar: grammar_lib.Grammar,
                        output_ids: Seq[int] = ()) -> grammar_lib.GrammarMatcher:
        """A matcher of `grammar` past `output_ids` (a restored sequence's output); raises
        ValueError naming the request when the grammar does not compile (or the model has
        no tokenizer, or llguidance, an optional extra, is absent)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"request {request_id!r}: a grammar needs the model's tokenizer, "
                             f"and this model has none")
        if self._grammars is None:
            self._grammars = grammar_lib.GrammarCompiler(
                tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        try:
            matcher = self._grammars.matcher(grammar)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        for token in output_ids:
            matcher.accept(token)
        return matcher

    def _max_pages_held(self, num_tokens: int) -> int:
        """The most pages a sequence of `num_tokens` tokens (prompt + output) holds at once.

        Admission takes pages a chunk at a time, so this only decides whether a request can
        ever fit the pool. A policy that evicts as it goes (streaming, h2o) caches fewer than
        budget + P tokens before a step and at most one prefill chunk more after it, and a
        compaction may take up to the budget's pages before it frees the old ones; so its
        requests may be longer than the pool. SnapKV keeps a whole prefill (after a recompute,
        prompt and output) before it compresses, so it gets no bound below its full length.
        """
        p, policy = self.config.page_size, self.kv_cache.retention.policy
        # Every block table's pages; a window's table holds its window and one step's writes (a
        # prefill chunk, or a verify row of 1 + gamma tokens).
        drafts = self.config.spec.num_draft_tokens if self.config.spec.enabled else 0
        full = self.kv_spec.max_pages_held(num_tokens, max(self.config.max_prefill_chunk,
                                                           1 + drafts))
        if policy.name not in _ROLLING_EVICTION or self.kv_cache.retention.default_budget is None:
            return full  # (a controller keeps every token until it sets a budget)
        uncompacted = pages_for(policy.budget + p - 1 + self.config.max_prefill_chunk, p)
        return min(full, uncompacted + pages_for(policy.budget, p))
