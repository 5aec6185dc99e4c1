"""The soak's model: small enough that two workers and their clients share two cores."""

from __future__ import annotations

from pathlib import Path

__all__ = ["make_tiny_model"]


def make_tiny_model(directory: Path) -> Path:
    """A random two-layer Llama of width 64 over SmolLM2's tokenizer, saved in `directory`:
    real forwards and KV caches at a few ms a batch, so two workers fit on two cores."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmqueue.workers.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    torch.manual_seed(37)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
