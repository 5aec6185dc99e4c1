"""What `import lmqueue` offers: every name of `__all__` exists, and every error is there.

A program catches a request's error as ``except lmqueue.Busy``; an error class added to
`lmqueue.shared.errors` without being exported would fail that silently, so the exported set is
checked against the classes the module defines (as httpx tests its exported members).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import lmqueue
import lmqueue.shared
from lmqueue.shared import errors


def _error_classes() -> dict[str, type]:
    return {
        name: value
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, errors.LMQueueError)
        and value.__module__ == errors.__name__
    }


@pytest.mark.parametrize("package", [lmqueue, lmqueue.shared, errors])
def test_every_exported_name_exists(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert len(names) == len(set(names)), "a name is exported twice"
    missing = [name for name in names if not hasattr(package, name)]
    assert missing == []


def test_every_error_class_is_exported() -> None:
    defined = _error_classes()
    assert len(defined) == 24
    exported = {
        name: getattr(lmqueue, name)
        for name in lmqueue.__all__
        if inspect.isclass(getattr(lmqueue, name))
        and issubclass(getattr(lmqueue, name), errors.LMQueueError)
    }
    assert exported == defined


def test_lmqueue_exports_the_client() -> None:
    assert {"QueueLM", "QueueTrie", "Experiments", "ExperimentStatus"} <= set(lmqueue.__all__)


def test_every_error_class_is_known_to_the_wire() -> None:
    for name, cls in _error_classes().items():
        rebuilt = errors.from_wire(errors.to_wire(cls("why", detail=1)))
        assert type(rebuilt) is cls, name
        assert (rebuilt.message, rebuilt.data) == ("why", {"detail": 1})


def test_a_new_error_class_registers_itself_for_the_wire() -> None:
    class ShapeMismatch(errors.BadRequest):
        """Raised when (in this test) a vector has the wrong shape."""

    rebuilt = errors.from_wire(errors.to_wire(ShapeMismatch("3 != 4", rows=3)))
    assert type(rebuilt) is ShapeMismatch
    assert isinstance(rebuilt, ValueError) and rebuilt.data == {"rows": 3}


def test_two_error_classes_cannot_share_a_wire_name() -> None:
    with pytest.raises(TypeError, match="Busy"):

        class Busy(errors.LMQueueError):  # noqa: F811 - the clash is the point
            """Raised never: its name is taken."""


def test_an_unknown_wire_name_becomes_the_root_error() -> None:
    rebuilt = errors.from_wire({"type": "NoSuchError", "message": "m", "data": {}})
    assert type(rebuilt) is errors.LMQueueError


def _module_files() -> list[Path]:
    root = Path(__file__).resolve().parent.parent
    folders = ("producer", "shared", "workers", "scheduler", "lmqueue")
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _module_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_public_module_name_is_in_all(path: Path) -> None:
    """A module's public classes and functions are in its ``__all__``, or private (``_``)."""
    tree = ast.parse(path.read_text())
    exported: list[str] | None = None
    public = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if not node.name.startswith("_"):
                public.append(node.name)
        elif isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            try:
                exported = list(ast.literal_eval(node.value))
            except ValueError:  # computed (workers.backends: from the backend list)
                return
    if exported is None:
        assert public == [] or path.name == "__main__.py", "public names but no __all__"
        return
    assert [name for name in public if name not in exported] == []
