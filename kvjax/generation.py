"""`kvjax.generate`: run a batch of prompts to completion on a fresh engine."""

from __future__ import annotations

from collections.abc import Sequence

from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.request import RequestOutput
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams


def encode_prompt(model: Model, prompt: str | Sequence[int], *, chat: bool = False
                  ) -> list[int]:
    """Token ids of a prompt: ids pass through as given (the engine checks them, so a float
    is never truncated into a token); text is tokenized (chat template if `chat`)."""
    if not isinstance(prompt, str):
        if not isinstance(prompt, Sequence):
            raise ValueError(f"a prompt is text or a sequence of token ids, got "
                             f"{type(prompt).__name__} {prompt!r:.80}")
        return list(prompt)
    if model.tokenizer is None:
        raise ValueError("a text prompt needs a model with a tokenizer; pass token ids instead")
    if chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return model.tokenizer.encode(prompt)


def generate(model: Model, prompts: Sequence[str | Sequence[int]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             engine_config: EngineConfig | None = None, chat: bool = False
             ) -> list[RequestOutput]:
    """Generates for every prompt (text or token ids) and returns one output per prompt.

    Each output carries the generated token ids, their text and per-token logprobs
    (`outputs[i]` for sample i of n). An invalid prompt comes back alone with `error` set;
    the others are served normally.
    """
    engine = Engine(model, engine_config)
    # Only text is encoded here: a malformed id prompt fails alone, inside engine.generate.
    ids = [encode_prompt(model, p, chat=chat) if isinstance(p, str) else p for p in prompts]
    return engine.generate(ids, sampling)
