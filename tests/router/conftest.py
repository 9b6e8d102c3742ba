"""Shared by the process tests of the router and of P/D: scripts/serve.py replicas of the tiny
chat model saved as a checkpoint."""

from __future__ import annotations

import pytest

from kvjax.testing import save_hf_checkpoint, tiny_chat_model


@pytest.fixture(scope="module")
def replica_page_size() -> int:
    return 8


@pytest.fixture(scope="module")
def replica_args(tmp_path_factory, replica_page_size) -> list[str]:
    """scripts/serve.py arguments of a small replica serving the tiny chat model."""
    directory = tmp_path_factory.mktemp("tiny")
    save_hf_checkpoint(tiny_chat_model(), directory)
    return [f"--model={directory}", f"--page_size={replica_page_size}", "--max_num_seqs=4",
            "--max_num_batched_tokens=64", "--max_prefill_chunk=32", "--max_model_len=128",
            "--config.engine.num_pages=96", "--config.engine.min_chunk_bucket=32",
            "--drain_timeout_s=5"]
