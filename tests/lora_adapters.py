"""Tiny LoRA adapters made at test time with PEFT: random, non-zero weights on a base model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Projections a test adapter changes: attention (so the KV differs per adapter) and the MLP.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str | Path, out_dir: str | Path, seed: int, rank: int = 4) -> Path:
    """Save a PEFT LoRA adapter of the causal LM in `model_dir` with random non-zero weights.

    ``init_lora_weights=False`` gives B a random init too (by default B is zero and the adapter
    a no-op), so every adapter made with another seed gives other rows.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_model = get_peft_model(base, config)
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    return out


def peft_reference(model_dir: str | Path, adapters: dict[str, Path]) -> Any:
    """A PEFT model of `model_dir` with `adapters` loaded, for in-process reference forwards."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def reference_logprobs(model: Any, tokens: list[int], adapter: str | None) -> Any:
    """Log-probabilities after `tokens` from one plain PEFT forward under `adapter` (None: base)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([tokens])
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=ids).logits
    return torch.log_softmax(logits[0, -1].float(), dim=-1)
