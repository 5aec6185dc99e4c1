"""Experiment kinds: async functions ``(ctx, lm, params) -> rows | None``.

Built in: ``score`` (log-probabilities of continuations), ``sample`` (ancestral samples),
``smc`` (constrained sequential Monte Carlo). Custom kinds are registered by name in the
scheduler's settings as ``"module:function"``, the way arq registers functions: a tenant can
only run kinds the operator registered, never import code of its choosing.

Every kind that calls a model takes the parameter ``adapter``: the name of a LoRA adapter of
the model, which the `lm` handed to the kind is bound to (`scheduler.run`), so each of its
calls computes under that adapter; absent or null, the base model. Comparing fine-tunes is
then one submission per adapter of the same kind and parameters.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from lmqueue.shared.errors import SettingsError
from lmqueue.shared.experiment_kinds import BUILTIN_KIND_SPECS, KindSpec, spec_of_function

from . import sample, score, smc

__all__ = ["Kind", "BUILTIN_KINDS", "resolve_kinds", "kind_specs"]

#: ``(ctx: ExperimentContext, lm: QueueLM | None, params: dict) -> list of rows | None``
Kind = Callable[[Any, Any, dict[str, Any]], Awaitable[Any]]

BUILTIN_KINDS: dict[str, Kind] = {"score": score.run, "sample": sample.run, "smc": smc.run}


def resolve_kinds(custom: Mapping[str, str]) -> dict[str, Kind]:
    """The built-in kinds and the custom ones (name -> "module:function"), imported.

    Raises:
        SettingsError: if a custom kind cannot be imported or is not an async function.
    """
    kinds = dict(BUILTIN_KINDS)
    for name, spec in custom.items():
        module_name, _, attribute = spec.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise SettingsError(f"kind {name!r} = {spec!r} cannot be imported: {exc}") from None
        if not callable(function):
            raise SettingsError(f"kind {name!r} = {spec!r} is not a function")
        kinds[name] = function
    return kinds


def kind_specs(kinds: Mapping[str, Kind]) -> dict[str, KindSpec]:
    """The catalog a scheduler publishes for `kinds` (`shared.experiment_kinds`)."""
    return {
        name: BUILTIN_KIND_SPECS[name]
        if BUILTIN_KINDS.get(name) is function and name in BUILTIN_KIND_SPECS
        else spec_of_function(function)
        for name, function in kinds.items()
    }
