"""``megagrpo score``: official IgakuQA scoring of prediction files against gold files."""

from __future__ import annotations

import argparse
import json
import logging

from megagrpo.errors import DataError
from megagrpo.rewards.igakuqa import ScoreReport, find_files, read_gold, read_predictions, score

DESCRIPTION = """\
Score predictions with the official IgakuQA rule: exact match of the comma-split prediction
(no stripping) against the gold answer list; 116A71 is correct for everyone; 112B30 accepts
'a' or 'd'. Prints accuracy, points score and totals, overall and per year, and the number of
questions whose prediction selected a contraindicated choice (禁忌肢, 'kinki' in the exams'
_metadata.jsonl).

Gold: EXAM-BLOCK.jsonl files or directories (searched recursively; *_metadata/*_translate
siblings skipped). Predictions: JSONL lines {"problem_id": ..., "prediction": "c,d"} for ONE
model; filter a directory of several models' files with --predictions-glob.

example:
  megagrpo score --gold data/igakuqa/2018 \\
      --predictions data/igakuqa/baseline_results --predictions-glob '*_gpt4.jsonl'
(data/igakuqa: IgakuQA's data/ years and baseline_results/; docs/igakuqa.md says where to get
it and how to lay it out)
"""

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gold", nargs="+", required=True, metavar="PATH", help="gold files or directories"
    )
    parser.add_argument(
        "--predictions",
        nargs="+",
        required=True,
        metavar="PATH",
        help="prediction files or directories (one model)",
    )
    parser.add_argument(
        "--predictions-glob",
        default=None,
        metavar="GLOB",
        help="only prediction files whose name matches (e.g. '*_gpt4.jsonl')",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def print_table(report: ScoreReport, by: str = "year") -> None:
    """Correct / total / accuracy / points score / points total / contraindicated choices
    selected, overall and per year (``by="year"``) or per exam file (``by="exam"``)."""
    groups = report.by_year if by == "year" else report.by_exam
    rows = [("all", report.overall)] + sorted(groups.items())
    print(f"{by:<8}{'correct':>8}{'total':>7}{'accuracy':>10}{'score':>7}{'points':>8}{'kinki':>7}")
    for name, t in rows:
        d = t.as_dict()
        print(
            f"{name:<8}{d['correct']:>8}{d['total']:>7}{d['accuracy']:>10.4f}"
            f"{d['score']:>7}{d['points_total']:>8}{d['kinki_selected']:>7}"
        )


def run(args: argparse.Namespace) -> int:
    gold_files = find_files(args.gold, gold=True)
    gold = read_gold(gold_files)
    if not gold:  # a score of 0 of 0 would read as a result (eval refuses the same)
        shown = ", ".join(map(str, gold_files[:5])) + (" ..." if len(gold_files) > 5 else "")
        raise DataError(f"--gold: no questions in {shown or ' '.join(args.gold)}")
    pred_files = find_files(args.predictions, gold=False, name_glob=args.predictions_glob)
    report = score(gold, read_predictions(pred_files))
    if report.missing:
        logger.warning(
            "%d gold problems have no prediction (counted wrong): %s",
            len(report.missing),
            ", ".join(report.missing[:20]) + (" ..." if len(report.missing) > 20 else ""),
        )
    if report.extra:
        logger.warning(
            "%d predictions have no gold problem (ignored): %s",
            len(report.extra),
            ", ".join(report.extra[:20]),
        )
    if args.json:
        print(json.dumps(report.as_dict(), ensure_ascii=False))
        return 0
    print_table(report)
    print(
        f"missing predictions: {len(report.missing)}"
        + (
            f" ({', '.join(report.missing[:10])}{' ...' if len(report.missing) > 10 else ''})"
            if report.missing
            else ""
        )
    )
    return 0
