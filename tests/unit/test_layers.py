"""The package's layer order: no import (module-level, lazy or type-only) points upward.

Each top-level room of ``megagrpo/`` (a sub-package or a module) sits on one layer; a room may
import from lower layers only, never from a higher one nor from another room of its own
layer (rooms of a layer are independent). docs/architecture.md ("Layout") draws the same table
(tests/unit/test_docs.py compares the two).
A new room fails here until it is given a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megagrpo"

LAYERS: list[set[str]] = [
    {"errors"},  # 0: ground: the error types everything raises
    {"types", "fileio", "profiling"},  # 1: data types, atomic file writes, allocator bytes
    {"config", "algo", "parallel", "data", "metrics", "testing"},  # 2: components
    # 3: built on components below; the Megatron policy (model) never imports rollout
    {"kernels", "rewards", "rollout", "curriculum", "model", "checkpoint"},
    # 4: where generation runs (placements, rounds, the wire, engine ranks); the upstream gate
    {"placement", "gate"},
    {"trainer", "plan"},  # 5: the loop; the before-you-rent-a-GPU predictors
    {"swift", "preflight"},  # 6: the ms-swift translator; the run's phases on a dummy copy
    {"commands", "cli"},  # 7: the command line
]
LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "megagrpo" and len(parts) > 1 else None


def _all_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import statement in ``path`` (``from megagrpo
    import x`` as ``megagrpo.x``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "megagrpo":
                out += [(node.lineno, f"megagrpo.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported megagrpo module)`` of every import statement in ``path``."""
    return [(line, m) for line, m in _all_imports(path) if m.startswith("megagrpo.")]


def _rooms() -> dict[str, list[Path]]:
    rooms: dict[str, list[Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py" and len(rel.parts) == 1:
            continue  # megagrpo/__init__.py: the package itself
        rooms.setdefault(rel.parts[0].removesuffix(".py"), []).append(path)
    return rooms


def test_every_room_has_a_layer():
    assert sorted(set(_rooms()) - set(LAYER_OF)) == []


def test_no_import_points_up_or_sideways():
    bad = []
    for room, paths in _rooms().items():
        for path in paths:
            for line, module in _imports(path):
                target = _room(module)
                if target is None or target == room or target not in LAYER_OF:
                    continue
                if LAYER_OF[target] >= LAYER_OF[room]:
                    rel = path.relative_to(PACKAGE.parent)
                    bad.append(f"{rel}:{line} {room} (L{LAYER_OF[room]}) -> {module}")
    assert bad == [], "imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", ["algo", "curriculum", "rewards", "data"])
def test_pure_rooms_import_no_megatron_vllm_or_distributed(room):
    heavy = ("megatron", "vllm", "torch.distributed")
    for path in (PACKAGE / room).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not [n for n in names if n.startswith(heavy)], path


def test_curriculum_imports_no_torch():
    """The curriculum's decisions are numpy only (its simulations live in megagrpo.plan)."""
    bad = []
    for path in (PACKAGE / "curriculum").rglob("*.py"):
        for line, name in _all_imports(path):
            if name == "torch" or name.startswith("torch."):
                bad.append(f"{path.name}:{line} {name}")
    assert bad == [], "torch in the curriculum:\n" + "\n".join(bad)


def test_the_trainer_never_probes_policies_or_engines():
    """The trainer talks to policies and engines through their protocols
    (megagrpo.model.Policy, megagrpo.rollout.RolloutEngine): no getattr / hasattr on them."""
    probed = ("policy", "engine", "rollouts")
    bad = []
    for path in (PACKAGE / "trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr") or not node.args:
                continue
            target = ast.unparse(node.args[0])
            if target.split(".")[-1] in probed:
                bad.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert bad == [], "probing instead of the protocol:\n" + "\n".join(bad)
