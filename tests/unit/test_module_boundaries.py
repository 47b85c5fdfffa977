"""Boundaries inside rooms that the layer table (test_layers.py) does not see: the checkpoint
format is readable without the training context, and no two modules import each other."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megagrpo"


def _path(module: str) -> Path | None:
    parts = module.split(".")[1:]
    if not parts:
        return PACKAGE / "__init__.py"
    rel = Path(*parts)
    for p in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if p.is_file():
            return p
    return None


def _walk(tree: ast.AST, type_only: bool):
    """``ast.walk``, skipping ``if TYPE_CHECKING:`` blocks unless ``type_only``."""
    for node in ast.iter_child_nodes(tree):
        skip = isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        if skip and not type_only:
            for n in node.orelse:
                yield n
                yield from _walk(n, type_only)
            continue
        yield node
        yield from _walk(node, type_only)


@cache
def _imports(module: str, type_only: bool = True) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(imported megagrpo module, names)`` of every import in ``module`` (module-level or
    lazy; type-only ones too unless ``type_only`` is False)."""
    path = _path(module)
    if path is None:
        return ()
    out = []
    for node in _walk(ast.parse(path.read_text(encoding="utf-8")), type_only):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = tuple(a.name for a in node.names)
            if node.module.startswith("megagrpo"):
                out.append((node.module, names))
                # ``from megagrpo.x import y``: y may itself be a module
                out += [(f"{node.module}.{n}", ()) for n in names if _path(f"{node.module}.{n}")]
        elif isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names if a.name.startswith("megagrpo")]
    return tuple(out)


def _reach(module: str) -> set[str]:
    """Every megagrpo module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        for target, _ in _imports(m):
            if target not in seen and _path(target) is not None:
                seen.add(target)
                todo.append(target)
    return seen


def test_export_reads_checkpoints_through_the_format_alone():
    reached = _reach("megagrpo.commands.export")
    assert "megagrpo.checkpoint.format" in reached  # the format: what export reads
    assert "megagrpo.trainer.train_state" not in reached  # save / restore of a TrainContext
    uses_context = sorted(
        m for m in reached if any("TrainContext" in names for _, names in _imports(m))
    )
    assert uses_context == [], f"export reaches modules that handle a TrainContext: {uses_context}"


def test_no_two_trainer_modules_import_each_other_at_run_time():
    modules = [
        f"megagrpo.trainer.{p.stem}" for p in (PACKAGE / "trainer").glob("*.py") if p.stem[0] != "_"
    ]
    direct = {m: {t for t, _ in _imports(m, type_only=False)} for m in modules}
    loops = sorted((a, b) for a in modules for b in direct[a] if b > a and a in direct.get(b, ()))
    assert loops == []
