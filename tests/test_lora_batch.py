"""`BatchedLora` on the tiny Llama: rows of several adapters in one forward, each equal to PEFT.

The adapters differ in rank, targets and scaling (rsLoRA, rank and alpha patterns), so a block
placed, scaled or masked wrongly shows in some row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import make_lora_adapter, peft_reference, reference_logprobs

from lmqueue.shared.errors import AdaptersUnsupported
from lmqueue.workers.backends.hf import AsyncTransformer
from lmqueue.workers.backends.lora_batch import BatchedLora, LoraLinear
from lmqueue.workers.backends.padded_batch import ForwardStats, Row, run_rows

TOLERANCE = 1e-4
#: r=4 with rsLoRA on three projections; r=8 on five, q_proj at rank 2, up_proj at alpha 3.
SMALL = {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj",
         "down_proj"]}  # fmt: skip
WIDE = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "o_proj", "up_proj",
        "gate_proj"], "rank_pattern": {"q_proj": 2}, "alpha_pattern": {"up_proj": 3}}  # fmt: skip
PROMPTS = [[1, 50, 60, 70], [1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5, 5], [1, 70, 60, 50]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-batch")
    return {
        "small": make_lora_adapter(tiny_model_dir, root / "small", 1, **SMALL),
        "wide": make_lora_adapter(tiny_model_dir, root / "wide", 2, **WIDE),
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, adapters: dict[str, Path]) -> Any:
    return peft_reference(tiny_model_dir, adapters)


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _forward(model: Any, lora: BatchedLora, names: list[str | None]) -> torch.Tensor:
    """Log-probabilities after each prompt, row i under ``names[i]``, in one forward."""
    ids = torch.tensor([PROMPTS[i % len(PROMPTS)] for i in range(len(names))])
    with torch.no_grad(), lora.rows(names):
        logits = model(input_ids=ids).logits
    return torch.log_softmax(logits[:, -1].float(), dim=-1)


def _assert_like_peft(rows: torch.Tensor, names: list, reference: Any, as_: dict | None = None):
    for i, name in enumerate(names):
        ref_name = (as_ or {}).get(name, name)
        expected = reference_logprobs(reference, PROMPTS[i % len(PROMPTS)], ref_name)
        assert (rows[i] - expected).abs().max().item() <= TOLERANCE, (i, name)


def test_interleaved_rows_of_the_base_and_two_adapters_each_equal_peft(
    model: Any, adapters: dict[str, Path], reference: Any
):
    lora = BatchedLora(model)
    for name, path in adapters.items():
        lora.load(name, str(path))
    q_proj = lora.layers["model.layers.0.self_attn.q_proj"]
    assert q_proj.blocks == {"small": slice(0, 4), "wide": slice(4, 6)}  # rank_pattern: q_proj 2
    assert set(lora.layers["model.layers.1.self_attn.v_proj"].blocks) == {"small"}
    names = [None, "small", "wide", "small", None, "wide", "wide"]
    rows = _forward(model, lora, names)
    _assert_like_peft(rows, names, reference)
    assert (rows[1] - rows[6 - 1]).abs().max() > 0.01  # the adapters do differ
    assert all(layer.active is None for layer in lora.layers.values())  # cleared after
    _assert_like_peft(_forward(model, lora, ["wide"] * 3), ["wide"] * 3, reference)


def test_a_forward_of_base_rows_only_runs_no_lora_product(
    model: Any, adapters: dict[str, Path], reference: Any
):
    lora = BatchedLora(model)
    lora.load("small", str(adapters["small"]))
    seen = []
    with lora.rows([None, None]):
        seen = [layer.active for layer in lora.layers.values()]
    assert seen and all(active is None for active in seen)
    _assert_like_peft(_forward(model, lora, [None, None]), [None, None], reference)


def test_rows_of_one_adapter_use_its_block_unmasked_and_mixed_rows_a_mask(
    model: Any, adapters: dict[str, Path]
):
    lora = BatchedLora(model)
    for name, path in adapters.items():
        lora.load(name, str(path))
    layer = lora.layers["model.layers.0.self_attn.q_proj"]
    with lora.rows(["wide", "wide"]):
        a, b, mask = layer.active
        assert mask is None and a.shape[0] == 2 and b.shape[0] == 2
    with lora.rows([None, "wide", "small"]):
        _, _, mask = layer.active
        assert mask is not None and mask.shape == (3, 1, 6)
        assert mask[:, 0].tolist() == [[0] * 6, [0] * 4 + [1] * 2, [1] * 4 + [0] * 2]


def test_loading_a_name_again_replaces_its_rows_and_its_layers(
    model: Any, adapters: dict[str, Path], reference: Any
):
    lora = BatchedLora(model)
    lora.load("small", str(adapters["small"]))
    lora.load("other", str(adapters["small"]))
    lora.load("small", str(adapters["wide"]))
    names = [None, "small", "other", "small"]
    renamed = {"other": "small", "small": "wide"}
    _assert_like_peft(_forward(model, lora, names), names, reference, renamed)
    _assert_like_peft(_forward(model, lora, ["small"] * 2), ["small"] * 2, reference, renamed)
    assert list(lora.layers["model.layers.0.self_attn.q_proj"].blocks) == ["other", "small"]
    assert set(lora.layers["model.layers.0.self_attn.v_proj"].blocks) == {"other"}
    assert set(lora.layers["model.layers.0.self_attn.k_proj"].blocks) == {"small"}


def test_a_batch_split_for_memory_gives_each_half_its_own_rows_adapters(
    model: Any, adapters: dict[str, Path], reference: Any, monkeypatch: pytest.MonkeyPatch
):
    lora = BatchedLora(model)
    for name, path in adapters.items():
        lora.load(name, str(path))
    forward = model.forward

    def small_batches_only(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", small_batches_only)
    names = ["wide", None, "small", "wide"]
    rows = [Row.fresh(tuple(PROMPTS[i]), name) for i, name in enumerate(names)]
    stats = ForwardStats()
    with torch.no_grad():
        outputs = run_rows(model, rows, None, {}, stats, lora)
    assert stats.oom_splits == 1 and stats.forwards == 2
    _assert_like_peft(torch.stack(outputs), names, reference)


def test_unloading_the_last_adapter_restores_the_models_own_linear_layers(
    model: Any, adapters: dict[str, Path]
):
    before = dict(model.named_modules())
    plain = _forward(model, BatchedLora(model), [None, None])
    lora = BatchedLora(model)
    for name, path in adapters.items():
        lora.load(name, str(path))
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), LoraLinear)
    lora.unload("small")
    assert not isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), LoraLinear)
    lora.unload("wide")
    lora.unload("wide")  # not loaded: nothing to do
    after = dict(model.named_modules())
    assert after.keys() == before.keys()
    assert all(after[name] is module for name, module in before.items())
    assert lora.names == frozenset() and lora.layers == {}
    assert torch.equal(_forward(model, lora, [None, None]), plain)


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"modules_to_save": ["norm"]}, "modules_to_save"),
        ({"target_modules": ["embed_tokens"]}, "embed_tokens"),
    ],
)
# PEFT's warnings on making and saving an adapter of the tied embeddings
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`")
def test_an_adapter_the_product_cannot_reproduce_is_refused_and_changes_nothing(
    model: Any, tiny_model_dir: Path, tmp_path: Path, config: dict, feature: str
):
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **config}
    path = make_lora_adapter(tiny_model_dir, tmp_path / "odd", 3, **options)
    before = dict(model.named_modules())
    lora = BatchedLora(model)
    with pytest.raises(AdaptersUnsupported, match="adapter 'odd': .*" + feature) as caught:
        lora.load("odd", str(path))
    assert caught.value.data["adapter"] == "odd"
    assert lora.names == frozenset() and dict(model.named_modules()) == before


async def test_the_hf_backend_refuses_a_dora_adapter_at_load_and_serves_the_others(
    tiny_model_dir: Path, adapters: dict[str, Path], reference: Any, tmp_path: Path
):
    dora = make_lora_adapter(tiny_model_dir, tmp_path / "dora", 4, target_modules=["q_proj"],
                             use_dora=True)  # fmt: skip
    lm = AsyncTransformer.from_name(str(tiny_model_dir), timeout=0.01)
    try:
        await lm.load_adapter("small", str(adapters["small"]))
        with pytest.raises(AdaptersUnsupported, match="use_dora"):
            await lm.load_adapter("dora", str(dora))
        assert lm.adapter_names == {"small"}
        row = await lm.next_token_logprobs(PROMPTS[0], "small")
        expected = reference_logprobs(reference, PROMPTS[0], "small")
        assert (row - expected).abs().max().item() <= TOLERANCE
    finally:
        await lm.aclose()
