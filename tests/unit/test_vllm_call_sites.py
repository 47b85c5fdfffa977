"""Every place megagrpo reaches into vLLM has an entry in docs/gpu.md's inventory, and every
entry names the contract test that executes it against vLLM 0.33.0 (or says why none can).

The scan (``call_sites``) reads every module of ``megagrpo/`` with ``ast`` and reports, per
file: each use of a name imported from ``vllm`` (a call, an attribute read, a patch of an
upstream attribute), each call or attribute read on a ``vllm.LLM`` (an attribute chain
through ``llm``), with ``apply_model`` / ``collective_rpc`` keyed by their target (the
function run in the worker, the worker method's name), each vLLM module path written as a
string (a logger megagrpo listens to). The inventory is the table under
"## vLLM call-site inventory" in docs/gpu.md: its first column lists the sites in
backticks, its third the tests (``tests/contract/test_*.py::test_*``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "gpu.md"
HEADING = "## vLLM call-site inventory"


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"] (None when it does not end in a Name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _target(call: ast.Call) -> str:
    """The function / method name ``apply_model`` or ``collective_rpc`` is asked to run."""
    if not call.args:
        return "?"
    arg = call.args[0]
    if isinstance(arg, ast.Constant):
        return repr(arg.value)
    if isinstance(arg, ast.Lambda):
        body = arg.body
        inner = _chain(body.func) if isinstance(body, ast.Call) else None
        return f"lambda: {'.'.join(inner[1:]) if inner else '?'}"
    if isinstance(arg, ast.Call):
        func = _chain(arg.func)
        if func and func[-1] == "partial" and arg.args:
            inner = _chain(arg.args[0])
            return inner[-1] if inner else "?"
    name = _chain(arg)
    return name[-1] if name else "?"


def _vllm_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the vLLM object it was imported as."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    names[(alias.asname or alias.name).split(".")[0]] = "vllm"
    return names


def sites_in(source: str, label: str) -> set[str]:
    """The vLLM call sites of one module's ``source`` as ``"label: site"`` strings."""
    tree = ast.parse(source)
    imported = _vllm_names(tree)
    found: set[str] = set()
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"vllm(\.\w+){2,}", node.value):  # a logger / module by name
                found.add(f"{label}: {node.value!r}")
            continue
        if not isinstance(node, ast.Attribute | ast.Name):
            continue
        if isinstance(parents.get(node), ast.Attribute):
            continue  # only the outermost attribute of a chain
        chain = _chain(node)
        if not chain:
            continue
        if chain[0] in imported:
            origin = [imported[chain[0]], *chain[1:]]
            call = parents.get(node)
            if (  # getattr / setattr of an upstream attribute named by a string
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Name)
                and call.func.id in ("getattr", "setattr")
                and len(call.args) >= 2
                and call.args[0] is node
                and isinstance(call.args[1], ast.Constant)
            ):
                origin.append(str(call.args[1].value))
            found.add(f"{label}: {'.'.join(origin)}")
            continue
        if "llm" in chain[:-1]:
            rest = chain[chain.index("llm") :]
            site = ".".join(rest)
            call = parents.get(node)
            if (
                isinstance(call, ast.Call)
                and call.func is node
                and rest[-1]
                in (
                    "apply_model",
                    "collective_rpc",
                )
            ):
                site += f"({_target(call)})"
            found.add(f"{label}: {site}")
    return found


def call_sites(root: Path = ROOT) -> set[str]:
    """Every vLLM call site under ``megagrpo/`` (labels: paths relative to the package)."""
    out: set[str] = set()
    pkg = root / "megagrpo"
    for path in sorted(pkg.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "vllm" not in source and "llm" not in source:
            continue
        out |= sites_in(source, path.relative_to(pkg).as_posix())
    return out


def inventory(doc: Path = DOC) -> dict[str, list[str]]:
    """docs/gpu.md's inventory: site -> the tests its row names."""
    text = doc.read_text(encoding="utf-8")
    assert HEADING in text, f"{doc} has no '{HEADING}' section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    out: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        tests = re.findall(r"(tests/[\w/]+\.py::\w+)", cells[2])
        for site in re.findall(r"`([^`]+)`", cells[0]):
            out[site] = tests
    return out


def test_every_vllm_call_site_has_an_inventory_entry():
    found, listed = call_sites(), inventory()
    missing = sorted(found - set(listed))
    stale = sorted(set(listed) - found)
    assert not missing, "vLLM call sites without an entry in docs/gpu.md's inventory:\n" + (
        "\n".join(missing)
    )
    assert not stale, "inventory entries no code has any more:\n" + "\n".join(stale)


def test_every_entry_names_tests_that_exist():
    for site, tests in inventory().items():
        assert tests, f"{site}: the inventory names no test"
        for test in tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text(encoding="utf-8")
            assert re.search(rf"^def {name}\(", source, re.M), f"{site}: {test} does not exist"


def test_a_new_call_site_is_found():
    """The scan itself: a module that adds a vLLM call (a new worker function, a new engine
    method, a new upstream import) yields sites the inventory does not list."""
    source = (
        "from vllm.distributed import get_pp_group\n"
        "def f(self):\n"
        "    self.llm.apply_model(new_probe)\n"
        "    self.llm.collective_rpc('save_sharded_state')\n"
        "    self.llm.llm_engine.pin_lora(3)\n"
        "    return get_pp_group().rank\n"
    )
    got = sites_in(source, "rollout/new.py")
    assert got == {
        "rollout/new.py: llm.apply_model(new_probe)",
        "rollout/new.py: llm.collective_rpc('save_sharded_state')",
        "rollout/new.py: llm.llm_engine.pin_lora",
        "rollout/new.py: vllm.distributed.get_pp_group",
    }
    assert not got & set(inventory())
