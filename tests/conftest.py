"""Shared fixtures: tiny real HF models (random weights, no download) and a clean environment."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> None:
    """Tiny forwards on 2 cores: OpenMP workers spin-waiting beside tracedump's writer thread make them
    ~20x slower. One intra-op thread keeps the suite fast; numbers do not depend on it."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_tracedump_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no TRACEDUMP_* variable, whatever the developer's shell exports."""
    for name in list(os.environ):
        if name.upper().startswith("TRACEDUMP_"):
            monkeypatch.delenv(name)


def make_tiny_llama(layers: int = 2, seed: int = 0, **overrides: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return make_tiny_llama()


@pytest.fixture
def prompt_ids() -> torch.Tensor:
    return torch.tensor([[3, 14, 15, 9, 26, 5]])
