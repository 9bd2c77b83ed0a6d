"""Random-weight models of Qwen3-0.6B's widths, the benchmarks' stand-in for a real checkpoint (none downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

QWEN3_06B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40_960,
}


def random_qwen3(folder: Path, layers: int) -> str:
    """A transformers checkpoint of Qwen3-0.6B's widths with ``layers`` decoder layers (seeded), saved in
    ``folder``; its path."""
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **QWEN3_06B)).save_pretrained(folder)
    return str(folder)
