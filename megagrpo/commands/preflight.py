"""`megagrpo preflight CONFIG [key=value ...] [--layers N] [--json]`: the run's exact config on
its model truncated to N layers, before the real job.

Every parallel dimension, the engine arguments, sync transport, offload and sleep levels stay
as configured; the model keeps its widths and experts but only ``--layers`` layers (default 2;
raised to a multiple of ``parallel.pp``), and nothing is read from disk: the trainer starts
from seeded stand-in weights and the engines from ``rollout.load_format=dummy``, then get
them through the run's verified sync. Phases (:mod:`megagrpo.preflight.phases`): start,
generate, sleep, wake, train, sync, skipped, checkpoint, resume, export. Run it like train
(``torchrun ... -m megagrpo.cli preflight CONFIG``, or ``PREFLIGHT=1 sbatch
slurm/grpo_235b.sh``).

Prints, per phase, pass/fail, seconds and measured peak memory (GPU:
``torch.cuda.max_memory_allocated``; CPU: the RSS high-water mark; max over ranks) next to
``plan-memory``'s prediction for the truncated model, and extrapolates to the full depth with
the planner's per-layer slope: ``measured + (L - N) x (plan(L) - plan(N)) / (L - N)``.
Exit status 0 when every phase passes, 1 naming the failed phase, 2 for a bad config.

Writes only into a directory it creates (``{trainer.output_dir}/.preflight/{trainer.name}-ID-FP``,
and a local copy of the model's config and tokenizer, ``$TMPDIR/megagrpo-preflight-model-ID-FP``)
and removes both at the end, after a failed phase, Ctrl-C and SIGTERM (Slurm's time limit or
preemption: exit status 143); ``--keep`` keeps the first for a look. ID is the launch's (Slurm
job id, torchrun's run id and port; a requeue or a second plain ``torchrun`` gets the same one);
FP fingerprints what the directory was made from (the truncated model for the copy, the model
and the whole config for the run directory), so a leftover of a killed launch is never taken
for another config's: a copy of the same name is used only when its files are the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from megagrpo import fileio
from megagrpo.commands.stdout import stdout_to_stderr
from megagrpo.errors import ConfigError, MegagrpoError

DESCRIPTION = __doc__

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (the one the job will run)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument("--layers", type=int, default=2, help="layers of the truncated model")
    parser.add_argument("--json", action="store_true", help="print only one JSON object")
    parser.add_argument("--keep", action="store_true", help="keep the preflight directory")


# ------------------------------------------------------------------ pure helpers
def truncated_hf_config(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """``hf`` with ``layers`` decoder layers (per-layer lists cut, layer indices filtered)."""
    out = dict(hf)
    out["num_hidden_layers"] = layers
    for key in ("layer_types",):
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    if isinstance(out.get("max_window_layers"), int):
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    return out


def preflight_layers(requested: int, pp: int, full: int) -> int:
    """Layers to run: ``requested`` raised to a multiple of ``pp`` (each stage one or more
    layers), at most the model's ``full`` depth."""
    if requested < 1:
        raise ConfigError(f"--layers must be >= 1, got {requested}")
    n = math.ceil(max(requested, pp) / pp) * pp
    return min(n, full)


def extrapolate(
    measured_gib: float, plan_n_gib: float, plan_full_gib: float, n: int, full: int
) -> dict[str, float]:
    """The full-depth estimate of a phase measured at ``n`` layers: the planner's per-layer
    slope ``(plan(full) - plan(n)) / (full - n)`` added ``full - n`` times to the measurement."""
    slope = (plan_full_gib - plan_n_gib) / (full - n) if full != n else 0.0
    return {
        "slope_gib_per_layer": slope,
        "extrapolated_gib": measured_gib + (full - n) * slope,
    }


def format_report(report: dict[str, Any]) -> str:
    """The text table of a report (:func:`build_report`)."""
    n, full = report["layers"], report["full_layers"]
    lines = [
        f"megagrpo preflight: {n} of {full} layers, {report['world_size']} rank(s), "
        f"memory: {report['memory_kind']}",
        f"{'phase':<11} {'result':<6} {'s':>7} {'peak GiB':>9} {'plan GiB':>9} "
        f"{'-> ' + str(full) + ' layers':>13} {'plan':>8}",
    ]
    mem = report["memory"]
    for ph in report["phases"]:
        m = mem.get(ph["name"])
        extra = (
            f" {m['plan_gib']:>9.2f} {m['extrapolated_gib']:>13.2f} {m['plan_full_gib']:>8.2f}"
            if m
            else ""
        )
        lines.append(
            f"{ph['name']:<11} {'ok' if ph['ok'] else 'FAIL':<6} {ph['seconds']:>7.1f} "
            f"{ph['peak_gib']:>9.2f}{extra}"
        )
    for v in report.get("violations", []):
        lines.append(f"compatibility: {v}")
    if report["ok"]:
        lines.append(f"preflight passed: all {len(report['phases'])} phases")
    else:
        lines.append(f"preflight FAILED in phase {report['failed_phase']}: {report['error']}")
    return "\n".join(lines)


def build_report(
    phases: list[dict[str, Any]],
    plan_n: dict[str, float],
    plan_full: dict[str, float],
    n: int,
    full: int,
    world: int,
    memory_kind: str,
    violations: list[str] | None = None,
) -> dict[str, Any]:
    """The JSON report: ``ok``, ``failed_phase``, ``error``, ``phases`` and ``memory`` (per
    phase the planner predicts, ``PLAN_PHASE``: measured, plan at ``n`` and at ``full``
    layers, and the extrapolation)."""
    from megagrpo.preflight.phases import PLAN_PHASE

    memory: dict[str, dict[str, float]] = {}
    for ph in phases:
        key = PLAN_PHASE.get(ph["name"])
        if key is None or not ph["ok"] or key not in plan_n:
            continue
        row = {
            "measured_gib": ph["peak_gib"],
            "plan_gib": plan_n[key],
            "plan_full_gib": plan_full[key],
        }
        row.update(extrapolate(ph["peak_gib"], plan_n[key], plan_full[key], n, full))
        memory[ph["name"]] = row
    failed = next((p for p in phases if not p["ok"]), None)
    return {
        "ok": failed is None and not violations,
        "failed_phase": failed["name"] if failed else ("compat" if violations else None),
        "error": failed["error"] if failed else ("; ".join(violations or []) or None),
        "layers": n,
        "full_layers": full,
        "world_size": world,
        "memory_kind": memory_kind,
        "phases": phases,
        "memory": memory,
        "plan_gib": plan_n,
        "plan_full_gib": plan_full,
        "violations": violations or [],
    }


# ------------------------------------------------------------------ the run
def _run_id() -> str:
    """The same on every rank of one launch, different across launches."""
    explicit = os.environ.get("MEGAGRPO_PREFLIGHT_ID")
    if explicit:
        return explicit
    parts = [
        os.environ.get("SLURM_JOB_ID", ""),
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("MASTER_PORT", ""),
    ]
    joined = "-".join(p for p in parts if p and p != "none")
    return joined or str(os.getpid())


class PreflightTerminated(BaseException):
    """SIGTERM (or SIGHUP) reached preflight: unwinds past the phases' ``except Exception``
    so that every ``finally`` removes what preflight created; the command exits 143."""


@contextlib.contextmanager
def _terminate_on_sigterm() -> Any:
    """SIGTERM / SIGHUP raise :class:`PreflightTerminated` once (a repeat during the clean-up
    is ignored); yields a function that re-asserts the handlers (an engine may replace them
    while it starts). Outside the main thread nothing is installed."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    signums = (signal.SIGTERM, signal.SIGHUP)
    fired: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        if not fired:
            fired.append(signum)
            raise PreflightTerminated(signal.Signals(signum).name)

    def install() -> None:
        for signum in signums:
            signal.signal(signum, handle)

    previous = {signum: signal.getsignal(signum) for signum in signums}
    install()
    try:
        yield install
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:12]


def _model_files(hf_dir: Path, layers: int) -> dict[str, bytes]:
    """The files of the model copy: ``hf_dir``'s config truncated to ``layers`` and its
    tokenizer files (no weights, no weight index)."""
    from megagrpo.model.arch import load_hf_config

    files = {
        f.name: f.read_bytes()
        for f in sorted(hf_dir.iterdir())
        if f.is_file()
        and f.name != "config.json"
        and not f.name.endswith(WEIGHT_SUFFIXES)
        and not f.name.endswith(".index.json")
    }
    hf = truncated_hf_config(load_hf_config(hf_dir), layers)
    files["config.json"] = json.dumps(hf, indent=1).encode()
    return files


def _same_files(d: Path, files: dict[str, bytes]) -> bool:
    try:
        names = sorted(p.name for p in d.iterdir())
        return names == sorted(files) and all((d / n).read_bytes() == b for n, b in files.items())
    except OSError:
        return False


def _model_copy(hf_dir: Path, layers: int, run_id: str) -> tuple[Path, bool]:
    """``hf_dir``'s config (truncated) and tokenizer files, no weights, in a local directory
    whose path is the same on every rank (checkpoints record it) and names the launch and a
    fingerprint of those files; returns it and whether this process created it (the ranks of
    a node race: the first rename wins, the others use it). A directory of that name whose
    files differ (tampered, half-written) is refused, never used (red team 3, M1)."""
    files = _model_files(hf_dir, layers)
    fp = _digest(*(x for name, data in sorted(files.items()) for x in (name, data)))
    target = Path(tempfile.gettempdir()) / f"megagrpo-preflight-model-{run_id}-{fp}"
    mine = Path(tempfile.mkdtemp(prefix="megagrpo-preflight-model-tmp-"))
    try:
        for name, data in files.items():
            fileio.write_bytes(mine / name, data)
        os.rename(mine, target)
        return target, True
    except OSError as exc:
        shutil.rmtree(mine, ignore_errors=True)
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
            raise MegagrpoError(f"cannot create the model copy {target}: {exc}") from exc
    except BaseException:
        shutil.rmtree(mine, ignore_errors=True)
        raise
    if not _same_files(target, files):  # the same name is the same files, or not ours
        raise MegagrpoError(
            f"{target} exists but does not hold {hf_dir}'s truncated config and "
            "tokenizer (left by another launch?); remove it to run preflight"
        )
    return target, False  # another rank of this node was first, or a leftover of the same


def _plan(cfg: Any, hf: dict[str, Any], world: int) -> dict[str, float]:
    from megagrpo.plan.memory import memory_plan
    from megagrpo.plan.scenario import Assumptions, scenario_from_config

    sc = scenario_from_config(cfg, hf).with_(num_gpus=world)
    return dict(memory_plan(sc, Assumptions())["phase_peak_gib"])


def _violations(cfg: Any, hf: dict[str, Any], world: int) -> list[str]:
    """The compatibility gate's violations (``megagrpo.gate.compat`` where it exists)."""
    try:
        from megagrpo.gate.compat import check_run  # type: ignore[import-not-found]
    except ImportError:
        return []
    return [str(v) for v in check_run(cfg, hf, world)]


def run(args: argparse.Namespace) -> int:
    if args.layers < 1:
        raise ConfigError(f"--layers must be >= 1, got {args.layers}")
    try:
        with _terminate_on_sigterm() as reinstall:
            return _run(args, reinstall)
    except PreflightTerminated as stop:
        print(
            f"megagrpo preflight: stopped by {stop}: its directories were removed",
            file=sys.stderr,
        )
        return 143


def _config_fingerprint(base: Any, model_dir: Path) -> str:
    """The run directory's fingerprint: the config (overrides applied) and the model copy's."""
    from megagrpo.config.loader import to_yaml

    return _digest(to_yaml(base), model_dir.name)


def _run(args: argparse.Namespace, reinstall: Any) -> int:
    from megagrpo.commands.train import _env_defaults

    _env_defaults()
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2)  # `kill -USR2 PID` prints where a rank waits
    if args.json:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import torch

    from megagrpo.config import load_config
    from megagrpo.model.arch import load_hf_config
    from megagrpo.model.pretrained import resolve_model_path
    from megagrpo.preflight.phases import as_dict, run_phases
    from megagrpo.trainer.config import RunConfig

    base = load_config(RunConfig, [args.config], args.overrides)
    hf_dir = resolve_model_path(base.model.hf_path)
    hf_full = load_hf_config(hf_dir)
    full = int(hf_full["num_hidden_layers"])
    n = preflight_layers(args.layers, base.parallel.pp, full)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    model_dir, own_model_dir = _model_copy(hf_dir, n, _run_id())
    run_dir: Path | None = None
    try:
        # hidden parent, plain run name: trainer.name may not start with a dot
        fp = _config_fingerprint(base, model_dir)
        run_dir = (
            Path(base.trainer.output_dir) / ".preflight" / f"{base.trainer.name}-{_run_id()}-{fp}"
        )
        if rank == 0 and run_dir.exists():
            run_dir_theirs, run_dir = run_dir, None  # never removed: not ours
            raise MegagrpoError(
                f"{run_dir_theirs} exists: a preflight of this launch ID and config "
                "is running, or one was killed (SIGKILL); remove it to run again"
            )
        cfg = load_config(
            RunConfig,
            [args.config],
            [
                *args.overrides,
                f"model.hf_path={model_dir}",
                "rollout.load_format=dummy",
                f"trainer.output_dir={run_dir.parent}",
                f"trainer.name={run_dir.name}",
                "metrics.wandb_mode=disabled",
            ],
        )
        hf_n = load_hf_config(model_dir)
        violations = _violations(base, hf_full, world)
        phases: list[dict[str, Any]] = []
        if not violations:
            with stdout_to_stderr(args.json):
                phases = [as_dict(r) for r in run_phases(cfg, before_phase=reinstall)]
        kind = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "RSS high-water"
        report = build_report(
            phases,
            _plan(cfg, hf_n, world),
            _plan(base, hf_full, world),
            n,
            full,
            world,
            kind,
            violations,
        )
    finally:
        if own_model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
        if rank == 0 and run_dir is not None and not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                run_dir.parent.rmdir()  # .preflight/ only when no other preflight uses it
    if rank == 0:
        print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0 if report["ok"] else 1
