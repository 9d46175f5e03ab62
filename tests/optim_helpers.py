"""Shared by the optimizer tests: batches of text, and a tiny Llama from transformers."""
from __future__ import annotations

import torch


def text_batches(tokens: torch.Tensor, steps: int, batch: int, context: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` random windows of ``context`` tokens, the same for every seed-equal call."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - context, (steps, batch), generator=generator)
    return [torch.stack([tokens[s : s + context] for s in row.tolist()]) for row in starts]


def tiny_llama(seed: int, hidden: int = 64, layers: int = 2, intermediate: int = 128, heads: int = 4,
               attention: str = "eager"):
    """A LlamaForCausalLM with a byte vocabulary, initialised from ``seed``. Eager attention by default: the
    same kernels forward and backward on every run, so two runs on the same data agree bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
