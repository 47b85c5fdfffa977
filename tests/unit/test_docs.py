"""The README stays short and points at every docs/ page; every relative link of the README
and docs/ resolves (file and heading); the set-up commands it names are the Makefile's; the
layer table of docs/architecture.md is the one tests/unit/test_layers.py enforces."""

from __future__ import annotations

import re
from pathlib import Path

from test_layers import LAYERS  # tests/unit/test_layers.py: the enforced layer order

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_is_short_and_links_every_docs_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    linked = {Path(t.split("#")[0]).name for t in LINK.findall(text) if t.startswith("docs/")}
    assert {p.name for p in DOCS} <= linked, "docs pages the README does not link"
    assert len(DOCS) >= 10


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert bad == [], "\n".join(bad)


def test_the_two_setup_commands_are_makefile_targets():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"^(\w[\w-]*):", (REPO / "Makefile").read_text(), flags=re.M)
    for cmd in ("demo", "test"):
        assert re.search(rf"^make {cmd}\s+#", text, flags=re.M), f"make {cmd} not in README"
        assert cmd in targets


def test_architecture_layer_table_is_the_enforced_one():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    drawn: dict[int, set[str]] = {}
    layer = -1
    for line in block.splitlines():
        m = re.match(r"^(L\d)?\s+(megagrpo/[^\s,]+(?:, [^\s,]+)*)", line)
        if not m:
            continue
        layer = int(m.group(1)[1:]) if m.group(1) else layer
        rooms = set(re.findall(r"(\w+)(?:/|\.py)", m.group(2))) - {"megagrpo"}
        drawn.setdefault(layer, set()).update(rooms)
    assert [drawn.get(i, set()) for i in range(max(drawn) + 1)] == LAYERS
