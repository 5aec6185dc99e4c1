"""What experiment kinds exist and which parameters each takes: checked when one is submitted.

Scheduler processes publish their catalog (built-in kinds and those the operator registered)
in the registry (`KeySpace.experiment_kinds`, readable by every tenant), so a client refuses
an unknown kind, a misspelt or mistyped parameter or an unpublished model at submit time,
with nothing queued, instead of the experiment failing minutes later. Until a scheduler has
published, the built-in kinds are known and nothing else.

A kind's parameters are name -> type (``int``, ``float``, ``str``, ``bool``, ``list``,
``object``); a custom kind declares them as a ``params`` attribute of its function (the
same mapping), or takes any parameters when it declares none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import BadRequest, MalformedMessage

__all__ = [
    "KindSpec",
    "BUILTIN_KIND_SPECS",
    "check_params",
    "encode_catalog",
    "decode_catalog",
    "spec_of_function",
]

_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "list": (list,),
    "object": (dict,),
}


@dataclass(frozen=True)
class KindSpec:
    """One kind's contract: its parameters (None: any) and whether it calls a model."""

    params: dict[str, str] | None = field(default_factory=dict)
    required: tuple[str, ...] = ()
    needs_model: bool = True

    def to_json(self) -> dict[str, Any]:
        """A JSON-able map."""
        return {"params": self.params, "required": list(self.required),
                "needs_model": self.needs_model}  # fmt: skip


BUILTIN_KIND_SPECS: dict[str, KindSpec] = {
    # every model kind: "adapter", the LoRA adapter its calls use (scheduler.kinds)
    "score": KindSpec({"rows": "list", "batch_size": "int", "adapter": "str"}, required=("rows",)),
    "sample": KindSpec(
        {
            "prompt": "str",
            "n": "int",
            "batch_size": "int",
            "max_tokens": "int",
            "temperature": "float",
            "seed": "int",
            "adapter": "str",
        },
        required=("prompt",),
    ),  # fmt: skip
    "smc": KindSpec(
        {
            "prompt": "str",
            "particles": "int",
            "steps": "int",
            "seed": "int",
            "lipogram": "str",
            "regex": "str",
            "adapter": "str",
        },
        required=("prompt",),
    ),  # fmt: skip
}


def check_params(kind: str, spec: KindSpec, params: Mapping[str, Any]) -> None:
    """Raise `BadRequest` naming the parameter unless `params` fit `spec`."""
    if spec.params is None:
        return
    unknown = sorted(set(params) - set(spec.params))
    if unknown:
        takes = ", ".join(f"{n} ({t})" for n, t in sorted(spec.params.items())) or "none"
        raise BadRequest(f"kind {kind!r} takes no parameter {', '.join(unknown)}; it takes {takes}")
    missing = [name for name in spec.required if name not in params]
    if missing:
        raise BadRequest(f"kind {kind!r} needs parameter {', '.join(missing)}")
    for name, value in params.items():
        expected = spec.params[name]
        types = _TYPES.get(expected, (object,))
        if not isinstance(value, types) or (isinstance(value, bool) and expected != "bool"):
            raise BadRequest(
                f"kind {kind!r}: parameter {name}={value!r} is not of type {expected}",
                remedy=f"give {name} as a JSON {expected} (e.g. --set {name}=...)",
            )


def encode_catalog(specs: Mapping[str, KindSpec]) -> str:
    """The catalog as published (JSON)."""
    return json.dumps({name: spec.to_json() for name, spec in sorted(specs.items())})


def decode_catalog(raw: bytes | str) -> dict[str, KindSpec]:
    """Parse a published catalog.

    Raises:
        MalformedMessage: if it is not one.
    """
    try:
        values = json.loads(raw)
        return {
            str(name): KindSpec(
                params=None
                if v["params"] is None
                else {str(k): str(t) for k, t in v["params"].items()},
                required=tuple(str(r) for r in v.get("required", ())),
                needs_model=bool(v.get("needs_model", True)),
            )
            for name, v in values.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise MalformedMessage(f"the published experiment kinds do not decode: {exc}") from None


def _param_types(raw: Any) -> dict[str, str] | None:
    return None if raw is None else {str(k): str(t) for k, t in raw.items()}


def spec_of_function(function: Any) -> KindSpec:
    """A custom kind's spec from its function's ``params`` (and ``needs_model``) attributes."""
    declared = getattr(function, "params", None)
    params = None if declared is None else {str(k): str(v) for k, v in dict(declared).items()}
    return KindSpec(params, tuple(getattr(function, "required", ())),
                    bool(getattr(function, "needs_model", False)))  # fmt: skip
