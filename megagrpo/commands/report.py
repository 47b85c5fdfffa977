"""`megagrpo report RUN_DIR [--hw-file FILE]`: PNG plots from runs/<name>/metrics.jsonl.

Draws collapse.png (raw ACR vs post-filter frac_reward_zero_std, with the ACR = 1 - 1/rounds
line above which dynamic sampling cannot fill a batch), reward.png, length.png, levels.png and
time.png into RUN_DIR/report/ (or --out: a new or empty directory; RUN_DIR/report may hold
only an earlier report, which the new one replaces); see :mod:`megagrpo.metrics.report`. The
number of checked rounds comes from the run's saved config.yaml (dynamic.policy,
dynamic.max_resample). ``--hw-file``: the cluster figures ``tools/measure_cluster.py``
measured, printed beside the planner's assumptions (:func:`megagrpo.plan.hwfile.comparison`)
and written to report/cluster.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
from pathlib import Path

from megagrpo import fileio
from megagrpo.errors import ConfigError, StorageError

DESCRIPTION = __doc__
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (runs/<name>)")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    parser.add_argument(
        "--max-resample",
        type=int,
        default=None,
        help="R for the 1 - 1/rounds line (default: dynamic.max_resample of RUN_DIR/config.yaml)",
    )
    parser.add_argument(
        "--hw-file",
        default=None,
        help="cluster figures measured by tools/measure_cluster.py: shown beside the planner's",
    )


def run_rounds(run_dir: Path, max_resample: int | None) -> int | None:
    """Rounds the run's dynamic sampling checked: 0 when it was off, None when the run has no
    readable config and no --max-resample was given."""
    from megagrpo.config import load_config
    from megagrpo.curriculum.dynamic import checked_rounds
    from megagrpo.trainer.config import RunConfig  # imports torch: not before --help

    saved = run_dir / "config.yaml"
    try:
        dynamic = load_config(RunConfig, [saved]).dynamic if saved.is_file() else None
    except ConfigError as exc:  # e.g. a config written by another version of megagrpo
        log.warning("%s: %s; the 1 - 1/rounds line needs --max-resample", saved, exc)
        dynamic = None
    if dynamic is None:
        if max_resample is None:
            return None
        dynamic = RunConfig().dynamic
    if max_resample is not None:
        dynamic = dataclasses.replace(dynamic, max_resample=max_resample)
    elif not dynamic.enabled:
        return 0
    return checked_rounds(dynamic)


def run(args: argparse.Namespace) -> int:
    from megagrpo.metrics.report import make_report

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    measured = None
    if args.hw_file:  # a bad file is named before anything is drawn
        from megagrpo.plan.hwfile import read_measurements

        measured = read_measurements(args.hw_file)
    try:
        paths = make_report(run_dir, args.out, run_rounds(run_dir, args.max_resample))
    except OSError as exc:  # disk full, a file size limit, a read-only run directory
        hint = ""
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            hint = "; pass --out DIR on a writable file system"
        raise StorageError(
            f"report not written ({fileio.describe_os_error(exc, exc.filename or out)})"
            f"{hint}; {out} is as it was"
        ) from exc
    for path in paths:
        print(path)
    if measured is not None:
        from megagrpo.plan.hwfile import comparison

        lines = comparison(measured)
        print("\n".join(lines))
        print(fileio.write_text(out / "cluster.txt", "\n".join(lines) + "\n"))
    return 0
