"""The installed ms-swift's argument dataclasses, read from its source without importing it
(importing ``swift.arguments`` pulls in torch, transformers and trl: 10-20 s; the Megatron
classes also need ``mcore_bridge``). Used by from-swift for a flag its tables do not list
(where ms-swift declares it says whether it is harmless: :mod:`megagrpo.swift.catalog`), and
by the tests that walk every field of ``RLHFArguments`` / ``MegatronRLHFArguments``.

The reader follows each class's bases through the module's ``from ... import`` lines (package
``__init__`` re-exports included) into ms-swift and transformers, and orders them by Python's
C3 linearisation, so a field's declaring class is the one ``dataclasses.fields`` reports.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

LAUNCHER_CLASSES = {
    "swift": ("swift.arguments.rlhf_args", "RLHFArguments"),
    "megatron": ("swift.megatron.arguments.rlhf_args", "MegatronRLHFArguments"),
}
"""The argument class each ``rlhf`` launcher parses its command line into."""


@dataclass(frozen=True)
class Field:
    """One dataclass field: its name, the class and module that declare it, the line."""

    name: str
    owner: str
    module: str
    line: int


def package_root(package: str) -> Path | None:
    """The directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def swift_version() -> str | None:
    """The installed ms-swift's version (``swift/version.py``), None without ms-swift."""
    root = package_root("swift")
    if root is None or not (root / "version.py").is_file():
        return None
    for node in ast.parse((root / "version.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(ast.literal_eval(node.value))
    return None


def _module_file(module: str) -> Path | None:
    top, _, rest = module.partition(".")
    root = package_root(top)
    if root is None:
        return None
    base = root.joinpath(*rest.split(".")) if rest else root
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=64)
def _parse(module: str) -> ast.Module | None:
    path = _module_file(module)
    return ast.parse(path.read_text(encoding="utf-8")) if path else None


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = str(_module_file(module)).endswith("__init__.py")
    parts = module.split(".")
    parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(parts + ([node.module] if node.module else []))


def _resolve(module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
    """``(module, class node)`` of the class ``name`` as seen from ``module``."""
    tree = _parse(module)
    if tree is None or depth > 8:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in _imports(tree.body):
        for alias in node.names:
            if (alias.asname or alias.name) == name:
                return _resolve(_absolute(module, node), alias.name, depth + 1)
    return None


def _imports(body: list[ast.stmt]) -> list[ast.ImportFrom]:
    """A module's ``from ... import`` lines, those under ``if TYPE_CHECKING:`` / ``try:`` too
    (ms-swift's packages re-export lazily)."""
    out: list[ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If | ast.Try):
            out += _imports(node.body + node.orelse)
    return out


def _linearise(module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases in C3 order (``object`` left out)."""
    found = _resolve(module, name)
    if found is None:
        raise LookupError(f"class {name} not found from {module}")
    where, node = found
    bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
    lines = [_linearise(where, b) for b in bases if b != "object"]
    order = [(where, node)]
    seqs = [list(x) for x in lines] + [[_resolve(where, b) for b in bases if b != "object"]]
    while any(seqs):
        for seq in seqs:
            if not seq:
                continue
            head = seq[0]
            if not any(head in s[1:] for s in seqs):
                break
        else:
            raise LookupError(f"no C3 order for {name}")
        order.append(head)  # pyright: ignore[reportArgumentType]
        seqs = [s[1:] if s and s[0] == head else s for s in seqs]
    return order  # pyright: ignore[reportReturnType]


def _fields_of(node: ast.ClassDef) -> list[tuple[str, int]]:
    out = []
    for st in node.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            if "ClassVar" not in ast.unparse(st.annotation):
                out.append((st.target.id, st.lineno))
    return out


@functools.lru_cache(maxsize=4)
def argument_fields(flavor: str) -> dict[str, Field]:
    """Every field of the installed ms-swift's argument class of ``flavor`` (swift |
    megatron), by name, with its declaring class; {} without ms-swift."""
    module, name = LAUNCHER_CLASSES[flavor]
    if _parse(module) is None:
        return {}
    out: dict[str, Field] = {}
    for where, node in _linearise(module, name):
        for field_name, line in _fields_of(node):
            out.setdefault(field_name, Field(field_name, node.name, where, line))
    return out


def declared(flag: str) -> Field | None:
    """Where the installed ms-swift declares ``flag`` (either launcher), None when it does not
    (or ms-swift is not installed)."""
    for flavor in LAUNCHER_CLASSES:
        try:
            found = argument_fields(flavor).get(flag)
        except (LookupError, OSError, SyntaxError):
            found = None
        if found is not None:
            return found
    return None
