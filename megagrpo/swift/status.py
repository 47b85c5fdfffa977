"""The status of a flag no rule of :mod:`megagrpo.swift` took, from the tables of
:mod:`megagrpo.swift.catalog` and, for a flag they do not list, from where the installed
ms-swift declares it (:mod:`megagrpo.swift.source`); and ms-swift 3.x names, read as their
4.6 flags."""

from __future__ import annotations

from typing import Any

from megagrpo.swift import catalog
from megagrpo.swift.flags import HARMLESS, MISSING, UNKNOWN, Translation


def classify(flag: str, value: Any) -> tuple[str, str]:
    """``(status, note)`` of ``flag`` given with ``value`` (see :mod:`~megagrpo.swift.catalog`)."""
    if flag in catalog.UNSUPPORTED:
        return MISSING, f"not supported: {catalog.UNSUPPORTED[flag]}"
    if flag in catalog.REFINES and not catalog.at_default(value, None):
        return MISSING, f"not supported: {catalog.REFINES[flag]}"
    if flag in catalog.DEFAULT_ONLY:
        default, why = catalog.DEFAULT_ONLY[flag]
        if catalog.at_default(value, default):
            return HARMLESS, f"ms-swift's default ({default!r}): nothing to carry over"
        return MISSING, f"not supported: {why}"
    for table in (catalog.HARMLESS, catalog.NO_EFFECT, catalog.OLD_3X):
        if flag in table:
            return HARMLESS, catalog.NOTES.get(flag) or table[flag]
    if flag in catalog.ARCHITECTURE_3X:
        return MISSING, (
            "not supported: an ms-swift 3.x override of the model's architecture (megagrpo "
            "builds the model from its config.json; drop the flag where it repeats config.json)"
        )
    return _by_declaration(flag)


def _by_declaration(flag: str) -> tuple[str, str]:
    """A flag the tables do not list: harmless when the installed ms-swift declares it in a
    logging class or it has a logging / run-name / hub / checkpoint name; else unknown."""
    from megagrpo.swift.source import declared, swift_version

    field = declared(flag)
    why = catalog.harmless_by_declaration(flag, field.owner if field else None)
    if why:
        return HARMLESS, why
    if field is not None:
        return UNKNOWN, (
            f"not known to from-swift: check it (ms-swift {swift_version()} declares it in "
            f"{field.owner}, {field.module.replace('.', '/')}.py:{field.line}; from-swift "
            f"knows ms-swift {catalog.SWIFT_VERSION})"
        )
    return UNKNOWN, (
        f"not known to from-swift: check it (no flag of ms-swift {catalog.SWIFT_VERSION}'s "
        "rlhf: a newer version's, an older one's, or a typo?)"
    )


def apply_renames(t: Translation) -> None:
    """ms-swift 3.x names given without their 4.6 flag are read as the 4.6 flag (the report
    shows the name as given: :func:`restore_names`)."""
    for flag in list(t.flags):
        new = catalog.renamed(flag, t.flavor)
        if new is not None and new not in t.flags:
            t.flags[new] = t.flags.pop(flag)
            t.renamed[new] = flag


def restore_names(t: Translation) -> None:
    """Report entries of renamed flags under the name the command gave."""
    for entry in t.entries:
        old = t.renamed.get(entry.flag)
        if old is not None and entry.given:
            entry.note = f"ms-swift 3.x name of --{entry.flag}" + (
                f"; {entry.note}" if entry.note else ""
            )
            entry.flag = old


def classify_rest(t: Translation) -> None:
    """A report entry for every flag no rule took."""
    for flag in list(t.flags):
        if flag in t.done:
            continue
        new = catalog.renamed(flag, t.flavor)
        if new is not None:  # both the 3.x name and its 4.6 flag given
            t.add(flag, HARMLESS, {}, f"ms-swift 3.x name of --{new}, also given: that is read")
            continue
        status, note = classify(flag, t.get(flag))
        t.add(flag, status, {}, note)
