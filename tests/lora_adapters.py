"""Tiny LoRA adapters made at test time with PEFT: random, non-zero weights on a base model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmqueue.bench.lib.adapter_models import make_random_adapter


def make_adapter(model_dir: str | Path, out_dir: str | Path, seed: int, rank: int = 4) -> Path:
    """A random non-zero PEFT LoRA adapter of the model in `model_dir` (see `adapter_models`)."""
    return make_random_adapter(model_dir, out_dir, seed, rank)


def make_lora_adapter(model_dir: str | Path, out_dir: str | Path, seed: int, **config: Any) -> Path:
    """A random non-zero PEFT adapter of the model in `model_dir` with `config`'s ``LoraConfig``
    options (``target_modules`` required; B random too, as in `make_adapter`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    options = {"init_lora_weights": False, "task_type": "CAUSAL_LM", **config}
    get_peft_model(base, LoraConfig(**options)).save_pretrained(str(out_dir))
    return Path(out_dir)


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
