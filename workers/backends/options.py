"""The one contract of a backend's options, and the refusal of options it cannot honour.

Every backend loads with ``Backend.from_name(model, *, engine_opts=None, **options)``:
`engine_opts` go to the engine underneath (``from_pretrained`` for hf, ``EngineArgs`` for
vLLM, ``ServerArgs`` for SGLang) and are the engine's to check; `options` are lmqueue's own
and each backend names the ones it honours in ``OPTIONS``. An option it does not honour is
refused with `SettingsError` naming it and the accepted ones, instead of being dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lmqueue.shared.errors import SettingsError

__all__ = ["check_options", "gpu_index"]


def check_options(backend: str, options: Mapping[str, Any], accepted: Iterable[str]) -> None:
    """Raise `SettingsError` if `options` names anything `backend` does not accept."""
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise SettingsError(
            f"the {backend} backend does not accept option(s) {', '.join(unknown)}; "
            f"it accepts engine_opts, {', '.join(sorted(accepted))}"
        )


def gpu_index(device: str) -> int:
    """The GPU number of a device name (``cuda:1`` or ``1``); `SettingsError` otherwise."""
    text = device.removeprefix("cuda:") if device.startswith("cuda:") else device
    if not text.isdigit():
        raise SettingsError(f"device={device!r}: expected cuda:N or N for a GPU engine")
    return int(text)
