#!/usr/bin/env bash
# mypy over the installed layout. The folders at the repository root install as subpackages of
# `lmqueue` (pyproject's package-dir), which mypy cannot follow; a tree of links in
# .typecheck/ has that layout, so mypy sees the modules under the names users import.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=.typecheck/lmqueue
rm -rf .typecheck && mkdir -p "$tree"
for entry in lmqueue/*; do ln -s "../../$entry" "$tree/"; done
for package in shared producer workers scheduler; do ln -s "../../$package" "$tree/$package"; done
MYPYPATH=.typecheck exec "${PYTHON:-python3}" -m mypy -p lmqueue "$@"
