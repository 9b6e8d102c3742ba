"""Batch rollouts for RL trainers: groups of samples per prompt, in the form a trainer consumes.

A `Rollout` submits one request of `group_size` samples per prompt (the samples share the
prompt's KV pages) and steps the engine. It records which weights version sampled each token,
so a trainer can call `Engine.update_weights` while the rollout is in flight and still know
which policy produced what. `result()` returns a `RolloutBatch`: per-sample lists and a padded
numpy batch (tokens, loss mask, old logprobs).

Seeds are deterministic: sample i of prompt p gets seed `base + p * group_size + i`, so a rerun
of the same prompts reproduces every sample, and equal prompts at different indices still get
different samples.

The engine reports logprobs of the model's raw distribution (before temperature, top-k and
top-p); at temperature 1 without filters they are exactly the behaviour policy's. Top-k
logprobs are not reported: the engine's step returns only the sampled token's logprob, and a
trainer recomputes full distributions with `kvjax.rl.grpo.token_logprobs` anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason, RequestOutput
from kvjax.sampling import SamplingParams


def check_groups(prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 group_size: int) -> None:
    """ValueError unless `group_size` samples of every prompt can be drawn with `sampling`."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if sampling.n not in (1, group_size):
        raise ValueError(f"sampling.n={sampling.n} conflicts with group_size={group_size}")
    if not prompts:
        raise ValueError("prompts is empty")


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Everything a policy-gradient trainer needs from one rollout.

    Samples are ordered prompt-major: sample b is sample `b % group_size` of prompt
    `b // group_size`, B = num_prompts * group_size.

    Attributes:
      prompt_ids: per prompt, its token ids.
      group_size: samples per prompt.
      completion_ids: [B] lists of generated token ids.
      logprobs: [B] float32 arrays, the logprob of each generated token under the weights that
        sampled it (raw distribution).
      token_versions: [B] lists, the weights version that sampled each generated token.
      finish_reasons: [B] FinishReason.
      texts: [B] decoded completions (None without a tokenizer).
      tokens: [B, T] int32, prompt then completion, right-padded with 0.
      loss_mask: [B, T] float32, 1 at generated tokens; aborted samples (cut by the engine,
        not ended by the policy) are all 0.
      old_logprobs: [B, T] float32, `logprobs` placed at the generated tokens, 0 elsewhere.
    """

    prompt_ids: list[list[int]]
    group_size: int
    completion_ids: list[list[int]]
    logprobs: list[np.ndarray]
    token_versions: list[list[str]]
    finish_reasons: list[FinishReason]
    texts: list[str | None]
    tokens: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray

    @property
    def num_samples(self) -> int:
        """B."""
        return len(self.completion_ids)

    @property
    def group_index(self) -> np.ndarray:
        """[B] int32, the prompt index of each sample."""
        return np.arange(self.num_samples, dtype=np.int32) // self.group_size

    @property
    def weights_versions(self) -> list[str]:
        """[B] the version that sampled each sample's last token ('' for an empty completion)."""
        return [v[-1] if v else "" for v in self.token_versions]


class Rollout:
    """One rollout batch in flight on an engine.

    The rollout drives the engine's steps (`step()`); while it runs, the engine should serve
    only it (outputs of other requests are handed back by `step()`). Between steps the caller
    may update the engine's weights under any `WeightUpdatePolicy`.

    `sampling` applies to every prompt; its `n` and `seed` are replaced by `group_size` and the
    derived per-prompt seeds (base `seed`). Request ids are `{name}/{prompt index}`.

    Attributes:
      engine: the engine the requests run on.
      request_ids: one request id per prompt.
    """

    def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams, *, group_size: int, seed: int = 0,
                 name: str = "rollout"):
        check_groups(prompts, sampling, group_size)
        self.engine = engine
        self.group_size = group_size
        self.request_ids = [f"{name}/{p}" for p in range(len(prompts))]
        self._prompts = [[int(t) for t in prompt] for prompt in prompts]
        self._outputs: dict[str, RequestOutput] = {}
        params = [dataclasses.replace(sampling, n=group_size,
                                      seed=(seed + p * group_size) % 2**32)
                  for p in range(len(prompts))]
        requests = list(zip(self.request_ids, self._prompts, params, strict=True))
        for request in requests:  # All or nothing: nothing is queued if one request is bad.
            engine.validate_request(*request)
        for request in requests:
            engine.add_request(*request)

    @property
    def done(self) -> bool:
        return len(self._outputs) == len(self.request_ids)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns finished outputs of requests that are not this rollout's."""
        others = []
        for out in self.engine.step():
            if out.request_id not in self._outputs and out.request_id in self.request_ids:
                self._outputs[out.request_id] = out
            else:
                others.append(out)
        return others

    def run(self) -> list[RequestOutput]:
        """Steps until every request of the rollout finished; returns other requests' outputs."""
        others = []
        while not self.done:
            others += self.step()
        return others

    def result(self, *, pad_to: int | None = None, pad_multiple: int = 16) -> RolloutBatch:
        """The finished rollout as a `RolloutBatch`.

        Args:
          pad_to: T, the padded length (a fixed T keeps a jitted trainer's shapes constant);
            None: the longest prompt + completion rounded up to `pad_multiple`.
        """
        if not self.done:
            raise ValueError(f"the rollout has {len(self.request_ids) - len(self._outputs)} "
                             "unfinished requests; step it until `done`")
        prompts, completions, logprobs, versions, reasons, texts = [], [], [], [], [], []
        for request_id, prompt in zip(self.request_ids, self._prompts, strict=True):
            out = self._outputs[request_id]
            if out.error:
                raise ValueError(f"request {request_id!r} failed: {out.error}")
            prompts.append(prompt)
            for sample in sorted(out.outputs, key=lambda s: s.index):
                completions.append(list(sample.token_ids))
                logprobs.append(np.asarray(sample.logprobs, np.float32))
                versions.append(list(sample.weights_versions))
                reasons.append(sample.finish_reason)
                texts.append(sample.text)
        tokens, loss_mask, old_logprobs = pad_batch(
            [prompts[b // self.group_size] for b in range(len(completions))], completions,
            logprobs, reasons, pad_to=pad_to, pad_multiple=pad_multiple)
        return RolloutBatch(prompt_ids=prompts, group_size=self.group_size,
                            completion_ids=completions, logprobs=logprobs,
                            token_versions=versions, finish_reasons=reasons, texts=texts,
                            tokens=tokens, loss_mask=loss_mask, old_logprobs=old_logprobs)


def pad_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
              logprobs: Sequence[np.ndarray], finish_reasons: Sequence[FinishReason], *,
              pad_to: int | None = None, pad_multiple: int = 16
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded (tokens [B, T] int32, loss_mask [B, T] float32, old_logprobs [B, T] float32).

    Row b is prompts[b] + completions[b]; the mask and logprobs sit at the completion's tokens.
    """
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple!r}")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    longest = max(lengths)
    t = pad_to if pad_to is not None else -(-longest // pad_multiple) * pad_multiple
    if t < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({longest} tokens)")
    b = len(completions)
    tokens = np.zeros((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.float32)
    old_logprobs = np.zeros((b, t), np.float32)
    for i, (prompt, completion, lp, reason) in enumerate(
            zip(prompts, completions, logprobs, finish_reasons, strict=True)):
        start, end = len(prompt), len(prompt) + len(completion)
        tokens[i, :start] = prompt
        tokens[i, start:end] = completion
        old_logprobs[i, start:end] = lp
        if reason is not FinishReason.ABORT:
            loss_mask[i, start:end] = 1.0
    return tokens, loss_mask, old_logprobs


def rollout(engine: Engine, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
            group_size: int, seed: int = 0, name: str = "rollout", pad_to: int | None = None
            ) -> RolloutBatch:
    """Samples `group_size` completions of every prompt to the end; see `Rollout`."""
    batch = Rollout(engine, prompts, sampling, group_size=group_size, seed=seed, name=name)
    batch.run()
    return batch.result(pad_to=pad_to)
