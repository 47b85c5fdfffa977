"""The Japanese medical licensing exam's pass criterion, per exam (IgakuQA year).

Since the 112th exam (2018) a candidate passes when all three hold (MHLW's published
criteria; the per-year thresholds of the general section are in docs/evaluation.md):

1. required section (必修問題: blocks B and E; general questions 1 point, clinical ones 3):
   at least 80% of its points (absolute; 160 of 200 when no question was excluded);
2. general section (the other blocks, every question 1 point): at least the year's threshold
   (relative, set each year: e.g. 209 of 296 points at the 113th exam, 2019);
3. contraindicated choices (禁忌肢) selected: at most 3.

Scored on the questions evaluated (image questions excluded count as wrong, as a missing
answer does). A year whose general threshold is not in :data:`GENERAL_PASS` (or given as a
fraction) reports the section's score and ``general_pass: None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megagrpo.rewards.igakuqa import GoldItem, ScoreReport, official_correct

REQUIRED_BLOCKS = frozenset({"B", "E"})
REQUIRED_FRACTION = 0.8
MAX_KINKI = 3
GENERAL_PASS: dict[str, tuple[int, int]] = {"113": (209, 296)}
"""Exam number -> (points needed, points available) of the general section, as published."""


@dataclass
class ExamPass:
    """One exam's three criteria and the verdict (None: a threshold is unknown)."""

    exam: str
    required_score: int = 0
    required_total: int = 0
    general_score: int = 0
    general_total: int = 0
    kinki_selected: int = 0
    general_threshold: float | None = None
    """Fraction of the general section's points needed (None: not known for this exam)."""

    @property
    def required_pass(self) -> bool:
        return self.required_score >= REQUIRED_FRACTION * self.required_total

    @property
    def general_pass(self) -> bool | None:
        if self.general_threshold is None:
            return None
        return self.general_score >= self.general_threshold * self.general_total

    @property
    def kinki_pass(self) -> bool:
        return self.kinki_selected <= MAX_KINKI

    @property
    def passed(self) -> bool | None:
        if not (self.required_pass and self.kinki_pass) or self.general_pass is False:
            return False
        return self.general_pass

    def as_dict(self) -> dict[str, Any]:
        return {
            "required": f"{self.required_score}/{self.required_total}",
            "required_pass": self.required_pass,
            "general": f"{self.general_score}/{self.general_total}",
            "general_threshold": self.general_threshold,
            "general_pass": self.general_pass,
            "kinki_selected": self.kinki_selected,
            "kinki_pass": self.kinki_pass,
            "passed": self.passed,
        }


def _block(item: GoldItem) -> str:
    return item.exam.rsplit("-", 1)[-1].upper()


def pass_criteria(
    gold: dict[str, GoldItem],
    predictions: dict[str, str],
    report: ScoreReport,
    general_fraction: float | None = None,
) -> dict[str, ExamPass]:
    """Exam number (``"113"``) -> its criteria over the scored questions. ``report``: the
    :func:`megagrpo.rewards.igakuqa.score` of the same predictions (its kinki list);
    ``general_fraction`` overrides the published general threshold of every exam."""
    kinki = set(report.kinki)
    out: dict[str, ExamPass] = {}
    for pid, item in gold.items():
        exam = item.exam.split("-", 1)[0]
        res = out.setdefault(exam, ExamPass(exam))
        pred = predictions.get(pid)
        # as megagrpo.rewards.igakuqa.score: a missing answer is wrong, except 116A71
        ok = official_correct(pid, pred, item.answer) if pred is not None else pid == "116A71"
        if _block(item) in REQUIRED_BLOCKS:
            res.required_total += item.points
            res.required_score += item.points if ok else 0
        else:
            res.general_total += item.points
            res.general_score += item.points if ok else 0
        res.kinki_selected += int(pid in kinki)
    for exam, res in out.items():
        if general_fraction is not None:
            res.general_threshold = general_fraction
        elif exam in GENERAL_PASS:
            need, available = GENERAL_PASS[exam]
            res.general_threshold = need / available
    return out


def format_pass(results: dict[str, ExamPass]) -> list[str]:
    """One line per exam for `megagrpo eval`'s table."""
    lines = []
    for exam, r in sorted(results.items()):
        verdict = {True: "PASS", False: "FAIL", None: "unknown (general threshold)"}[r.passed]
        general = (
            f"{r.general_score}/{r.general_total} (needs {r.general_threshold:.1%}: "
            f"{'ok' if r.general_pass else 'no'})"
            if r.general_threshold is not None
            else f"{r.general_score}/{r.general_total} (threshold not known: --general-pass)"
        )
        lines.append(
            f"exam {exam}: required {r.required_score}/{r.required_total} (needs 80%: "
            f"{'ok' if r.required_pass else 'no'}); general {general}; 禁忌肢 "
            f"{r.kinki_selected} (<= 3: {'ok' if r.kinki_pass else 'no'}) -> {verdict}"
        )
    return lines
