"""Official IgakuQA scoring (``jungokasai/IgakuQA`` ``scripts/evaluate_main.py``), on raw files.

The rule, exactly: a prediction string is split on ``,`` (no stripping, no case folding) and
correct iff ``sorted(prediction.split(',')) == sorted(gold)``; problem ``116A71`` counts as
correct for everyone; ``112B30`` (gold ``["a or d"]``) accepts ``a`` or ``d``. Accuracy =
correct / questions; score = sum of ``points`` (a string in the data) over correct questions;
points total = sum over all questions. Unlike the official script (which zips two files
line by line), predictions are joined to gold by ``problem_id``; gold problems without a
prediction count as wrong and are listed in ``missing``.

Gold files: ``YEAR/EXAM-BLOCK.jsonl`` (``112-A.jsonl``); ``*_metadata``/``*_translate``
siblings are skipped when searching directories. This module reads them itself so scoring
does not depend on prompt rendering.

Contraindicated choices (禁忌肢): ``EXAM-BLOCK_metadata.jsonl`` lists, per question, the
``kinki`` option letters (entries such as ``"c"``, ``"cde"``, full-width ``"ｄ"``). A
prediction *selects* a contraindicated choice when its letters intersect that set
(:func:`kinki_selected`); the real exam fails a candidate who selects too many of them
whatever the score, so they are counted per exam next to the score.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagrpo.data.gold import igakuqa_gold
from megagrpo.data.loader import read_jsonl
from megagrpo.errors import DataError

GOLD_NAME_RE = re.compile(r"^\d+-[A-Za-z]+\.jsonl$")
ALWAYS_CORRECT = "116A71"
EITHER_A_OR_D = "112B30"


@dataclass
class GoldItem:
    """One gold question: ``answer`` normalised (:func:`megagrpo.data.gold.igakuqa_gold`),
    ``points`` as int."""

    problem_id: str
    answer: list[str]
    points: int
    year: str
    source: str
    kinki: frozenset[str] = frozenset()
    """Contraindicated option letters (from the exam's _metadata.jsonl; empty if none)."""

    @property
    def exam(self) -> str:
        """The exam file's stem (``112-A``), from ``source`` (``.../112-A.jsonl:5``)."""
        return Path(self.source.rsplit(":", 1)[0]).stem


@dataclass
class Tally:
    """Counts for one group of questions, derived from one mark per question answered."""

    marks: list[tuple[bool, int, bool]] = field(default_factory=list)
    """(correct, points, selected a contraindicated choice) per question, in scoring order."""

    def add(self, ok: bool, points: int, kinki: bool = False) -> None:
        self.marks.append((ok, points, kinki))

    @property
    def total(self) -> int:
        return len(self.marks)

    @property
    def correct(self) -> int:
        return sum(ok for ok, _, _ in self.marks)

    @property
    def score(self) -> int:
        return sum(points for ok, points, _ in self.marks if ok)

    @property
    def points_total(self) -> int:
        return sum(points for _, points, _ in self.marks)

    @property
    def kinki_selected(self) -> int:
        return sum(kinki for _, _, kinki in self.marks)

    def as_dict(self) -> dict[str, Any]:
        correct, total = self.correct, self.total
        return {
            "correct": correct,
            "total": total,
            "accuracy": correct / total if total else 0.0,
            "score": self.score,
            "points_total": self.points_total,
            "kinki_selected": self.kinki_selected,
        }


@dataclass
class ScoreReport:
    """Overall and per-year tallies, plus missing gold ids and predictions without gold."""

    overall: Tally = field(default_factory=Tally)
    by_year: dict[str, Tally] = field(default_factory=dict)
    by_exam: dict[str, Tally] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    kinki: list[str] = field(default_factory=list)
    """Questions whose prediction selected a contraindicated choice (with kinki data)."""

    def as_dict(self) -> dict[str, Any]:
        out = self.overall.as_dict()
        out["kinki_selected"] = len(self.kinki)
        out["kinki_problems"] = list(self.kinki)
        out["by_year"] = {y: t.as_dict() for y, t in sorted(self.by_year.items())}
        out["by_exam"] = {e: t.as_dict() for e, t in sorted(self.by_exam.items())}
        out["missing"] = list(self.missing)
        out["num_missing"] = len(self.missing)
        out["extra"] = list(self.extra)
        return out


def official_correct(problem_id: str, prediction: str, gold: list[str]) -> bool:
    """The official per-question rule (see module docstring)."""
    pred = sorted(prediction.split(","))
    if problem_id == ALWAYS_CORRECT:
        return True
    if problem_id == EITHER_A_OR_D and pred in (["a"], ["d"]):
        return True
    return pred == sorted(gold)


def find_files(
    paths: Iterable[str | Path], *, gold: bool, name_glob: str | None = None
) -> list[Path]:
    """Files named in ``paths``, directories searched recursively for ``*.jsonl`` (gold: only
    ``EXAM-BLOCK.jsonl`` names). ``name_glob`` filters file names (e.g. ``'*_gpt4.jsonl'``)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(p.rglob("*.jsonl"))
            found = [f for f in found if not gold or GOLD_NAME_RE.match(f.name)]
        elif p.is_file():
            found = [p]
        else:
            raise DataError(f"no such file or directory: {p}")
        out += [f for f in found if name_glob is None or fnmatch.fnmatch(f.name, name_glob)]
    if not out:
        kind = "gold" if gold else "prediction"
        raise DataError(
            f"no {kind} files found in {', '.join(map(str, paths))}"
            + (f" matching '{name_glob}'" if name_glob else "")
        )
    return out


def _year_of(path: Path, problem_id: str) -> str:
    if re.fullmatch(r"\d{4}", path.parent.name):
        return path.parent.name
    m = re.match(r"(\d{3})", problem_id)
    return str(int(m.group(1)) + 1906) if m else "unknown"  # exam 112 was held in 2018


_FW = str.maketrans("ａｂｃｄｅｆｇｈＡＢＣＤＥＦＧＨ", "abcdefghabcdefgh")


def read_kinki(gold_file: Path) -> dict[str, frozenset[str]]:
    """problem_id -> contraindicated letters from ``<exam>_metadata.jsonl`` beside
    ``gold_file`` ({} when there is no metadata file)."""
    meta = gold_file.with_name(gold_file.stem + "_metadata.jsonl")
    if not meta.is_file():
        return {}
    out: dict[str, frozenset[str]] = {}
    for num, rec in read_jsonl(meta):
        raw = rec.get("kinki") or []
        if not isinstance(raw, list):
            raise DataError(f"{meta}:{num}: 'kinki' must be a list of option letters")
        letters = "".join(str(x) for x in raw).translate(_FW).lower()
        out[str(rec.get("problem_id"))] = frozenset(c for c in letters if "a" <= c <= "h")
    return out


def kinki_selected(prediction: str, kinki: frozenset[str]) -> bool:
    """The prediction (``"c,d"``) selects at least one contraindicated choice."""
    return bool(kinki) and bool(set(prediction.split(",")) & kinki)


def read_gold(files: Iterable[Path], limit: int = 0) -> dict[str, GoldItem]:
    """problem_id -> GoldItem, in file order (with the exams' kinki letters). ``limit`` > 0:
    only the first ``limit`` questions of each file. Answers are normalised as training
    normalises them (:func:`megagrpo.data.gold.igakuqa_gold`: ``"Ｃ"`` is ``c``, ``"26"`` one
    number). DataError naming file:line on bad records, impossible answers or duplicate ids."""
    gold: dict[str, GoldItem] = {}
    for path in files:
        kinki = read_kinki(path)
        for i, (num, rec) in enumerate(read_jsonl(path)):
            if limit and i >= limit:
                break
            where = f"{path}:{num}"
            for key in ("problem_id", "answer", "points"):
                if key not in rec:
                    raise DataError(f"{where}: gold record without '{key}'")
            pid = str(rec["problem_id"])
            choices = rec.get("choices")
            num_choices = len(choices) if isinstance(choices, list) else 0
            answer = igakuqa_gold(rec["answer"], num_choices, f"{where}: {pid}")
            try:
                points = int(rec["points"])
            except (TypeError, ValueError, OverflowError) as exc:
                raise DataError(f"{where}: 'points' of {pid} is not an integer") from exc
            if pid in gold:
                raise DataError(
                    f"{where}: duplicate problem_id {pid} (first in {gold[pid].source})"
                )
            gold[pid] = GoldItem(
                pid, answer, points, _year_of(path, pid), where, kinki.get(pid, frozenset())
            )
    return gold


def read_predictions(files: Iterable[Path]) -> dict[str, str]:
    """problem_id -> prediction string. A duplicate id (two models' files mixed) is an error."""
    preds: dict[str, str] = {}
    seen: dict[str, str] = {}
    for path in files:
        for num, rec in read_jsonl(path):
            where = f"{path}:{num}"
            if "problem_id" not in rec or "prediction" not in rec:
                raise DataError(f"{where}: prediction record needs 'problem_id' and 'prediction'")
            pid, pred = str(rec["problem_id"]), rec["prediction"]
            if not isinstance(pred, str):
                raise DataError(f"{where}: 'prediction' of {pid} must be a string")
            if pid in preds:
                raise DataError(
                    f"{where}: second prediction for {pid} (first at {seen[pid]}); "
                    "score one model at a time (use --predictions-glob)"
                )
            preds[pid], seen[pid] = pred, where
    return preds


def score(gold: dict[str, GoldItem], predictions: dict[str, str]) -> ScoreReport:
    """Official scoring of ``predictions`` against every gold question, per year and per
    exam file, with the contraindicated choices selected."""
    report = ScoreReport()
    for pid, item in gold.items():
        pred = predictions.get(pid)
        if pred is None:
            report.missing.append(pid)
        ok = pred is not None and official_correct(pid, pred, item.answer)
        if pred is None and pid == ALWAYS_CORRECT:
            ok = True  # the official rule credits 116A71 whatever was predicted
        kinki = pred is not None and kinki_selected(pred, item.kinki)
        if kinki:
            report.kinki.append(pid)
        report.overall.add(ok, item.points, kinki)
        report.by_year.setdefault(item.year, Tally()).add(ok, item.points, kinki)
        report.by_exam.setdefault(item.exam, Tally()).add(ok, item.points, kinki)
    report.extra = sorted(set(predictions) - set(gold))
    return report
