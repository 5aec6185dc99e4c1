"""Imports point down and never in a circle, read from the source with `ast`.

Layers, top to bottom: the application (`lmqueue`'s own modules: CLI, demo, benchmarks), then
`scheduler`, then `producer` and `workers` (side by side, never importing each other), then
`shared`. Every import counts, those under ``TYPE_CHECKING`` and inside functions too: a cycle
that only type hints close is still two modules that must change together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("shared", "producer", "workers", "scheduler")

#: What each layer may import from lmqueue (besides itself).
ALLOWED = {
    "shared": set(),
    "producer": {"shared"},
    "workers": {"shared"},
    "scheduler": {"shared", "producer"},
    "app": {"shared", "producer", "workers", "scheduler"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.joinpath("lmqueue").rglob("*.py"):
        found[_name(("lmqueue", *path.relative_to(ROOT / "lmqueue").parts))] = path
    for package in SUBPACKAGES:
        for path in ROOT.joinpath(package).rglob("*.py"):
            found[_name(("lmqueue", *path.relative_to(ROOT).parts))] = path
    return found


def _name(parts: tuple[str, ...]) -> str:
    parts = (*parts[:-1], parts[-1].removesuffix(".py"))
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lmqueue modules that `name` imports (a package's __init__ for `from pkg import x`
    unless x is itself a module)."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + int(is_package)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in modules else base)
    return {t for t in targets if t in modules and t != name}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else "app"


def test_every_import_points_down() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            if _layer(target) != _layer(name) and _layer(target) not in ALLOWED[_layer(name)]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_two_modules_import_each_other_directly_or_around_a_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ re-exporting its modules is not a cycle with them.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_bench_commands_share_only_the_harness() -> None:
    """A benchmark command imports `lmqueue.bench.lib` (and its own package), never another
    command; the harness imports no command."""
    modules = _modules()
    commands = {
        name
        for name in modules
        if name.startswith("lmqueue.bench.")
        and not name.startswith("lmqueue.bench.lib")
        and name not in ("lmqueue.bench.commands", "lmqueue.bench.__main__")
    }

    def command_of(module: str) -> str:
        return ".".join(module.split(".")[:3])  # lmqueue.bench.<command>[.<part>]

    crossing = [
        f"{name} -> {target}"
        for name, path in modules.items()
        if name in commands or name.startswith("lmqueue.bench.lib")
        for target in _imports(name, path, modules)
        if target in commands and command_of(target) != command_of(name)
    ]
    assert crossing == []
