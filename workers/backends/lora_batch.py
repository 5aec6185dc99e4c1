"""`BatchedLora`: LoRA adapters on a model's Linear layers, every adapter of a forward at once.

Each targeted ``nn.Linear`` is replaced by a `LoraLinear` computing::

    base(x) + ((x @ A) * mask) @ B

where ``A`` ``[d_in, R]`` stacks every loaded adapter's ``lora_A`` of that layer (kept as
``[R, d_in]``, so one adapter's block is contiguous), ``B`` ``[R, d_out]`` their ``lora_B``
with each adapter's scaling folded in (R: the sum of their ranks), and ``mask``
``[rows, 1, R]`` selects each row's block (all zeros for a base row) and broadcasts over the
sequence. PEFT's own mixed-adapter batches loop in Python over the adapters in every layer
(SmolLM2-135M, 32 rows of base and 3 adapters, one new token each, one torch thread: PEFT
+39% over the base model, this +10%). The rows' adapters are set around a forward (`rows`);
a layer that no row's adapter targets runs its plain Linear, so a forward of base rows only
costs the base model's time, and rows all of one adapter use its block without a mask.

PEFT stays the loader and the reference: the config is read with ``LoraConfig``, the weights
with ``load_peft_weights``, and each module's scaling is PEFT's (``lora_alpha / r``, or
``/ sqrt(r)`` with ``use_rslora``; ``rank_pattern`` and ``alpha_pattern`` matched with
``peft.utils.other.get_pattern_key``, the one name not exported by ``peft.utils``, exercised
by the rank-pattern test). The modules an adapter targets are those its weights name.

An adapter this computation cannot represent exactly is refused at load time with
`AdaptersUnsupported` naming the feature, before any layer changes: LoRA variants (DoRA,
aLoRA, Arrow...), initialisations that rewrite the base weights (PiSSA, OLoRA, LoftQ...),
``bias`` or ``lora_bias``, ``modules_to_save``, trainable tokens, ``fan_in_fan_out``,
QALoRA, layer replication, target parameters, and weights on anything but an ``nn.Linear``
(embeddings, convolutions). One path serves every adapter; none falls back to PEFT's.

The adapter's matrices keep the base weight's dtype (float32 under a quantized base); PEFT
computes half-precision models' LoRA term in float32, so rows there differ by rounding only.
Forwards may run on several threads at once (each thread's rows are its own); load and unload
must not run beside a forward (the backend's `ModelChangeLock` sees to it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lmqueue.shared.errors import AdaptersUnsupported

__all__ = ["BatchedLora", "LoraLinear"]

#: How PEFT names a LoRA weight in a saved adapter: ``base_model.model.<module>.lora_A.weight``.
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}
#: ``init_lora_weights`` values that leave the base weights as they are.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
#: Config fields that change the computation when set (truthy), besides the LoRA variants.
_UNSUPPORTED_FIELDS = (
    "fan_in_fan_out", "modules_to_save", "lora_bias", "trainable_token_indices", "use_qalora",
    "layer_replication", "target_parameters", "megatron_config",
)  # fmt: skip

#: One adapter's weights by module name: ``A [r, d_in]`` and ``B [r, d_out]``, scaled.
_Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]
#: A layer's blocks for one forward: ``(A, B, mask)``, mask None when every row uses the block.
_Active = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class LoraLinear(nn.Module):
    """A Linear layer plus the concatenated LoRA blocks of the adapters that target it."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        #: Adapter name -> its rows of `a` and `b`, in load order.
        self.blocks: dict[str, slice] = {}
        #: `blocks` and the device, hashable: layers of one layout share a forward's mask.
        self.layout: tuple[Any, ...] = ()
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self._per_thread = threading.local()

    @property
    def active(self) -> _Active | None:
        """What this thread's forward adds (set by `BatchedLora.rows`); None: the plain Linear.
        Per thread: forwards on several threads at once each have rows of their own."""
        return getattr(self._per_thread, "active", None)

    @active.setter
    def active(self, value: _Active | None) -> None:
        self._per_thread.active = value

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.active is None:
            return y
        a, b, mask = self.active
        h = x.to(a.dtype) @ a.t()
        if mask is not None:
            if h.dim() != 3 or h.shape[0] != mask.shape[0]:
                raise RuntimeError(f"LoRA rows for {mask.shape[0]} rows, input {tuple(x.shape)}")
            h = h * mask
        return y + (h @ b).to(y.dtype)

    def rebuild(self, weights: _Weights) -> None:
        """Concatenate `weights` (adapter -> ``A [r, d_in]``, scaled ``B [r, d_out]``; one at
        least)."""
        self.blocks, start = {}, 0
        for name, (a, _) in weights.items():
            self.blocks[name] = slice(start, start + a.shape[0])
            start += a.shape[0]
        self.a = torch.cat([a for a, _ in weights.values()], dim=0).contiguous()
        self.b = torch.cat([b for _, b in weights.values()], dim=0).contiguous()
        spans = tuple((name, block.start, block.stop) for name, block in self.blocks.items())
        self.layout = (spans, self.a.device)


class BatchedLora:
    """The LoRA adapters of `model`, by name, served together in one forward (see above)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._adapters: dict[str, _Weights] = {}
        self._layers: dict[str, LoraLinear] = {}
        #: The adapters loaded: a snapshot replaced whole, for readers on other threads.
        self.names: frozenset[str] = frozenset()

    @property
    def layers(self) -> dict[str, LoraLinear]:
        """The replaced layers by module name (read-only use, for tests)."""
        return dict(self._layers)

    def load(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter at `path` as `name`, replacing one of that name.

        Raises:
            AdaptersUnsupported: the adapter uses a feature this computation lacks (the
                model is unchanged).
            ValueError, OSError: `path` holds no readable PEFT adapter.
        """
        weights = self._read(name, path)
        touched = set(weights) | set(self._adapters.get(name, ()))
        self._adapters.pop(name, None)  # a replaced adapter's blocks go last, as a new one's
        self._adapters[name] = weights
        self._rebuild(touched)
        self.names = frozenset(self._adapters)

    def unload(self, name: str) -> None:
        """Forget adapter `name` (if loaded); layers no adapter targets get their Linear back."""
        weights = self._adapters.pop(name, None)
        if weights is not None:
            self._rebuild(set(weights))
            self.names = frozenset(self._adapters)

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Compute the forward run inside with row i under ``adapters[i]`` (None: the base)."""
        used = {name for name in adapters if name is not None}
        masks: dict[tuple[Any, ...], torch.Tensor] = {}  # layers of one layout share a mask
        try:
            for layer in self._layers.values():
                if not used.isdisjoint(layer.blocks):
                    layer.active = _active(layer, adapters, masks)
            yield
        finally:
            for layer in self._layers.values():
                layer.active = None

    def _rebuild(self, modules: set[str]) -> None:
        for module in sorted(modules):
            weights = {
                name: adapter[module]
                for name, adapter in self._adapters.items()
                if module in adapter
            }
            layer = self._layers.get(module)
            if not weights:
                if layer is not None:
                    self._swap(module, layer.base)
                    del self._layers[module]
                continue
            if layer is None:
                base = self.model.get_submodule(module)
                assert isinstance(base, nn.Linear)  # checked by `_read`
                layer = self._layers[module] = LoraLinear(base)
                self._swap(module, layer)
            layer.rebuild(weights)

    def _swap(self, module: str, new: nn.Module) -> None:
        parent, _, child = module.rpartition(".")
        setattr(self.model.get_submodule(parent), child, new)

    def _read(self, name: str, path: str) -> _Weights:
        """The adapter at `path`, checked against the model, its B matrices scaled."""
        from peft import LoraConfig
        from peft.utils import load_peft_weights

        config = LoraConfig.from_pretrained(path)
        _check_config(name, config)
        pairs: dict[str, list[torch.Tensor | None]] = {}
        for key, tensor in load_peft_weights(path, device="cpu").items():
            module, which = _split_key(name, key)
            pairs.setdefault(module, [None, None])[which] = tensor
        weights: _Weights = {}
        for module, (a, b) in pairs.items():
            if a is None or b is None:
                raise _unsupported(name, f"module {module} has only one of lora_A and lora_B")
            base = self._base_linear(name, module)
            rank, scaling = _scaling(config, module)
            expected = ((rank, base.in_features), (base.out_features, rank))
            if (tuple(a.shape), tuple(b.shape)) != expected:
                shapes = f"A {tuple(a.shape)} and B {tuple(b.shape)}, expected {expected}"
                raise _unsupported(name, f"weights of {module}: {shapes}")
            dtype = base.weight.dtype if base.weight.is_floating_point() else torch.float32
            device = base.weight.device
            weights[module] = (
                a.to(device=device, dtype=dtype),
                (b.t().to(torch.float32) * scaling).to(device=device, dtype=dtype),
            )
        return weights

    def _base_linear(self, name: str, module: str) -> nn.Linear:
        layer = self._layers.get(module)
        if layer is not None:
            return layer.base
        try:
            found = self.model.get_submodule(module)
        except AttributeError:
            raise _unsupported(name, f"weights of {module}, not a module of the model") from None
        if not isinstance(found, nn.Linear):
            raise _unsupported(name, f"LoRA on {module}, a {type(found).__name__}")
        return found


def _active(
    layer: LoraLinear, adapters: Sequence[str | None], masks: dict[tuple[Any, ...], torch.Tensor]
) -> _Active:
    """What `layer` computes for rows of `adapters` (one of its adapters at least): the block
    of that adapter alone when every row has it, else all blocks under a mask."""
    a, b = layer.a, layer.b
    assert a is not None and b is not None
    first = adapters[0]
    if first is not None and all(name == first for name in adapters):
        block = layer.blocks[first]
        return a[block], b[block], None
    mask = masks.get(layer.layout)
    if mask is None:
        mask = torch.zeros((len(adapters), 1, a.shape[0]), dtype=a.dtype)
        for i, name in enumerate(adapters):
            if name in layer.blocks:
                mask[i, 0, layer.blocks[name]] = 1
        mask = masks[layer.layout] = mask.to(a.device, non_blocking=True)
    return a, b, mask


def _check_config(name: str, config: Any) -> None:
    """Refuse a config whose LoRA this computation does not reproduce (see the docstring)."""
    if config.peft_type != "LORA":
        kind = getattr(config.peft_type, "value", config.peft_type)
        raise _unsupported(name, f"peft_type={kind} (LoRA only)")
    if config.bias != "none":
        raise _unsupported(name, f"bias={config.bias!r}")
    if config.init_lora_weights not in _PLAIN_INITS:
        raise _unsupported(name, f"init_lora_weights={config.init_lora_weights!r}")
    variants = [f.name for f in dataclasses.fields(config) if f.metadata.get("is_lora_variant")]
    for field in (*variants, *_UNSUPPORTED_FIELDS):
        if getattr(config, field, None):
            raise _unsupported(name, f"{field}={getattr(config, field)!r}")


def _split_key(name: str, key: str) -> tuple[str, int]:
    """The module a saved weight belongs to, and 0 for its A matrix, 1 for B."""
    for suffix, which in _SUFFIXES.items():
        if key.startswith(_PREFIX) and key.endswith(suffix):
            return key[len(_PREFIX) : -len(suffix)], which
    raise _unsupported(name, f"weight {key}")


def _scaling(config: Any, module: str) -> tuple[int, float]:
    """PEFT's rank and scaling of `module`: alpha / r, or alpha / sqrt(r) with rsLoRA, where
    ``rank_pattern`` and ``alpha_pattern`` may set r and alpha per module."""
    from peft.utils.other import get_pattern_key

    ranks: dict[str, int] = config.rank_pattern or {}
    alphas: dict[str, float] = config.alpha_pattern or {}
    rank = int(ranks.get(get_pattern_key(list(ranks), module), config.r))
    alpha = float(alphas.get(get_pattern_key(list(alphas), module), config.lora_alpha))
    return rank, alpha / math.sqrt(rank) if config.use_rslora else alpha / rank


def _unsupported(name: str, feature: str) -> AdaptersUnsupported:
    return AdaptersUnsupported(
        f"adapter {name!r}: {feature} is not supported by the hf backend's batched LoRA",
        adapter=name,
        feature=feature,
    )
