"""Random LoRA adapters of a model, and merged copies of them, made with PEFT (the adapters bench
and the adapter tests).

``init_lora_weights=False`` gives B a random init too (PEFT's default makes B zero and the
adapter a no-op), so adapters made with different seeds give different rows.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TARGETS", "make_random_adapter", "merge_adapter"]

#: Projections an adapter changes: attention (so the KV differs per adapter) and the MLP.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_random_adapter(
    model_dir: str | Path, out_dir: str | Path, seed: int, rank: int = 8, scale: float = 1.0
) -> Path:
    """Save a PEFT LoRA adapter of the causal LM in `model_dir` with random non-zero weights.

    `scale` multiplies the B matrices (PEFT's random B is small on wide models: ~1/sqrt(width)).
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
    model = get_peft_model(base, config)
    if scale != 1.0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(scale)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Save the model of `model_dir` with the adapter merged into its weights (one plain model
    per fine-tune: what serving without adapters needs), tokenizer included."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out
