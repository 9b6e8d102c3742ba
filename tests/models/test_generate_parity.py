"""kvjax.generate against Hugging Face `generate` on the same weights: token-identical greedy."""

from __future__ import annotations

import pytest
from hf_utils import hf_greedy, make_tiny_hf_checkpoint

import kvjax
from kvjax.models.hf import load_hf

NEW_TOKENS = 32
ENGINE = dict(page_size=8, max_num_seqs=4, max_prefill_chunk=64, max_num_batched_tokens=128,
              max_model_len=256)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", [kvjax.KVLayout.PAGED, kvjax.KVLayout.CONTIGUOUS])
def test_tiny_checkpoint_generate_matches_hf(tmp_path, model_type, layout):
    directory = make_tiny_hf_checkpoint(tmp_path, model_type, seed=3)
    model = load_hf(directory)
    prompts = [[5, 17, 250, 3], list(range(40, 77)), [299]]
    expected = [hf_greedy(directory, p, NEW_TOKENS) for p in prompts]
    outs = kvjax.generate(model, prompts,
                          kvjax.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                          engine_config=kvjax.EngineConfig(kv_layout=layout, **ENGINE))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_embedded_model_generate_matches_hf(embedded_model, hf_embedded):
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write one sentence about the ocean."]
    prompts = [kvjax.encode_prompt(embedded_model, q, chat=True) for q in questions]
    expected = [hf_greedy(hf_embedded, p, NEW_TOKENS) for p in prompts]
    outs = kvjax.generate(embedded_model, prompts,
                          kvjax.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                          engine_config=kvjax.EngineConfig(**ENGINE))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert "Paris" in outs[0].outputs[0].text
