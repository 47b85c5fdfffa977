"""The run config's dotted keys, and those added since a recorded list: what a fuzz of new
config keys (like tests/unit/test_fuzz_inputs.py's readers) should cover.

``python tests/unit/config_keys.py`` prints the keys added since cabf39c (red team 4's
commit; ``config_keys_cabf39c.txt`` is that commit's :func:`schema_keys`, one a line).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "config_keys_cabf39c.txt"


def schema_keys(schema: type | None = None) -> list[str]:
    """Every leaf key of the config dataclass ``schema`` (default: the run config), dotted
    and sorted (``loss.sapo_tau_pos``; a list of sections such as ``rewards.functions`` is
    one key)."""
    if schema is None:
        from megagrpo.trainer.config import RunConfig

        schema = RunConfig

    def walk(cls: type, prefix: str) -> typing.Iterator[str]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                yield from walk(kind, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    return sorted(walk(schema, ""))


def keys_added_since(recorded: Path = RECORDED, schema: type | None = None) -> list[str]:
    """The keys of ``schema`` not in the ``recorded`` list (one dotted key a line)."""
    old = set(recorded.read_text(encoding="utf-8").split())
    return [key for key in schema_keys(schema) if key not in old]


if __name__ == "__main__":
    print("\n".join(keys_added_since()))
