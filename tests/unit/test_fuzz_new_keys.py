"""Fuzz of the config keys added since red team 4's commit (cabf39c): every hostile value,
given as a command-line override, is accepted or refused with a ConfigError naming the key,
never a raw traceback (TypeError, AttributeError, OverflowError, ...).

The keys are read off the schema (``config_keys.keys_added_since``), so a key added later is
fuzzed without editing this file. The values are those of red team 4's reproductions (wrong
types, YAML flows, non-finite and huge numbers, control and bidi characters, interpolations).
"""

from __future__ import annotations

import pytest
from config_keys import keys_added_since

from megagrpo.config import load_config
from megagrpo.errors import ConfigError
from megagrpo.trainer.config import RunConfig

HOSTILE = [
    "",
    "null",
    "~",
    "true",
    "false",
    "0",
    "-1",
    "2",
    "1e309",
    "-1e309",
    "nan",
    ".nan",
    "inf",
    "9" * 40,
    "0.5",
    "abc",
    "'1'",
    "[1, 2]",
    "{a: 1}",
    "a:b",
    "\u202eevil",
    "a\x1bb",
    "${oc.env:HOME}",
    "${missing.key}",
]

KEYS = keys_added_since()


def test_the_round_added_keys():
    """The list is not empty: a fuzz over nothing would pass vacuously."""
    assert "trainer.shared_prefix" in KEYS and "cluster.host_memory_gib" in KEYS, KEYS


@pytest.mark.parametrize("key", KEYS)
def test_hostile_values_are_taken_or_named(key):
    raw = []
    for value in HOSTILE:
        try:
            load_config(RunConfig, [], [f"{key}={value}"])
        except ConfigError as exc:
            msg = str(exc)
            if key not in msg:
                raw.append((value, f"ConfigError not naming {key}: {msg[:200]}"))
        except Exception as exc:  # noqa: BLE001 - what the fuzz looks for
            raw.append((value, f"{type(exc).__name__}: {str(exc)[:200]}"))
    assert not raw, raw
