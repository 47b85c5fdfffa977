"""ms-swift's own functions, compiled alone from its installed source: importing the modules
that hold them pulls in trl, vLLM or megatron-core (20-50 s on the shared test machine) for
functions that read only their arguments. Tests run these against megagrpo."""

from __future__ import annotations

import ast
import importlib.util
import logging
import typing
from pathlib import Path
from typing import Any

import pytest
import torch


def swift_tree(relpath: str) -> tuple[Path, ast.Module]:
    """The parsed ``swift/<relpath>`` of the installed ms-swift (the test skips without it)."""
    spec = importlib.util.find_spec("swift")
    if spec is None or spec.origin is None:
        pytest.skip("ms-swift is not installed")
    path = Path(spec.origin).parent / relpath
    return path, ast.parse(path.read_text(encoding="utf-8"))


def swift_function(relpath: str, name: str, cls: str | None = None, **names: Any):
    """``swift/<relpath>``'s function ``name`` (a method of class ``cls``), compiled alone
    with ``torch``, ``typing``'s names, a ``logger`` and ``names`` as its globals."""
    path, tree = swift_tree(relpath)
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns: dict[str, Any] = {k: getattr(typing, k) for k in typing.__all__}
    ns |= {"torch": torch, "logger": logging.getLogger("swift"), **names}
    exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    return ns[name]


def swift_class(relpath: str, name: str, **names: Any) -> type:
    """``swift/<relpath>``'s class ``name``, compiled alone (its bases must be given in
    ``names`` unless it has none), with the globals of :func:`swift_function`."""
    path, tree = swift_tree(relpath)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    ns: dict[str, Any] = {k: getattr(typing, k) for k in typing.__all__}
    ns |= {"torch": torch, "logger": logging.getLogger("swift"), **names}
    exec(compile(ast.Module([node], []), str(path), "exec"), ns)
    return ns[name]


def swift_defs(relpath: str, *names: str, **extra: Any) -> dict[str, Any]:
    """Several top-level functions / classes of ``swift/<relpath>`` compiled together alone
    (one namespace, so they see each other), with ``dataclass`` and ``extra`` as globals."""
    import dataclasses

    path, tree = swift_tree(relpath)
    nodes = [
        n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names
    ]
    assert {n.name for n in nodes} == set(names), f"{relpath}: {names}"
    ns: dict[str, Any] = {k: getattr(typing, k) for k in typing.__all__}
    ns |= {"torch": torch, "logger": logging.getLogger("swift"),
           "dataclass": dataclasses.dataclass, "field": dataclasses.field, **extra}  # fmt: skip
    body: list[ast.stmt] = list(nodes)
    exec(compile(ast.Module(body, []), str(path), "exec"), ns)
    return {name: ns[name] for name in names}


def swift_advantage(name: str) -> Any:
    """``swift.rl_core.advantage.<name>`` compiled alone: importing ``swift.rl_core`` loads
    the trainers' stack (20 s on the shared machine) for functions that read their arguments."""
    nanstd = swift_function("utils/torch_utils.py", "nanstd")
    return swift_defs(
        "rl_core/advantage.py", "RewardMetrics", "compute_advantages", "compute_reward_metrics",
        nanstd=nanstd,
    )[name]  # fmt: skip
