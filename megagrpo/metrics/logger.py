"""Metric loggers: metrics.jsonl, W&B (offline by default), TensorBoard, a console progress bar.

A :class:`MetricLogger` takes one flat ``{name: float}`` dict per step. Rank 0 builds the
real loggers with :func:`build_logger`; every other rank gets :class:`NullLogger` (the
nanochat ``DummyWandb`` idea), so call sites never branch on rank.

metrics.jsonl: one JSON object per line, ``{"step": int, "time": float, <name>: value}``;
values that a step did not measure (e.g. ``collapse/acr_predicted`` without a levels file)
are written as ``null`` so every row holds every name. On resume the rows of steps after the
checkpoint are dropped (:meth:`JsonlLogger.truncate_after`) so the file reads as one run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from megagrpo import fileio
from megagrpo.errors import ConfigError, DataError, StorageError
from megagrpo.metrics.config import MetricsConfig

log = logging.getLogger(__name__)


class MetricLogger(Protocol):
    """Anything that takes one row of metrics per step."""

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        """Record ``metrics`` for ``step`` (1-based optimiser step)."""

    def close(self) -> None:
        """Flush and release resources."""


def _clean(value: Any) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


class NullLogger:
    """No-op logger for ranks other than 0."""

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON row per step to ``path`` (written unbuffered and fsynced each step).
    A row that cannot be written whole (disk full, file size limit) is cut off again and
    StorageError names the file and the free space; a torn last row left by a kill is
    dropped when a resumed run opens the file (:meth:`truncate_after`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = fileio.open_append(self.path)

    def truncate_after(self, step: int) -> int:
        """Drop rows with ``step > step`` (a resumed run rewrites them) and a torn last row;
        returns rows kept."""
        self._fh.close()
        rows = read_metrics(self.path) if self.path.exists() else []
        kept = [r for r in rows if r.get("step", 0) <= step]
        fileio.write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._fh = fileio.open_append(self.path)
        return len(kept)

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        row = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: _clean(v) for k, v in sorted(metrics.items())})
        data = memoryview((json.dumps(row) + "\n").encode("utf-8"))
        fd = self._fh.fileno()
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, start)  # no torn row
            except OSError:
                pass
            why = fileio.describe_os_error(exc, self.path)
            raise StorageError(f"metrics row of step {step} not written ({why})") from exc

    def close(self) -> None:
        self._fh.close()


class WandbLogger:
    """Real ``wandb`` run; ``mode`` offline (default, no key), online or disabled.

    The run id is kept in ``run_dir/wandb_id`` so a resumed training continues the same run.
    Logging never costs the training run: ``wandb.init`` is bounded by
    ``metrics.wandb_init_timeout_s``; a failed online init falls back to offline (same id), a
    failed init of that id to a new id in the same group, and when W&B cannot start at all it
    is skipped with a warning (metrics.jsonl holds every row regardless).
    """

    def __init__(self, cfg: MetricsConfig, run_dir: Path, name: str, config: dict | None = None):
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        fileio.write_text(id_file, run_id)
        wandb_dir = Path(cfg.wandb_dir or run_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = dict(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=name,
            resume="allow",
            dir=str(wandb_dir),
            mode=cfg.wandb_mode,
            config=config or {},
            settings=wandb.Settings(
                silent=True,
                console="off",
                x_disable_stats=True,
                init_timeout=float(cfg.wandb_init_timeout_s),
            ),
        )
        self._run = _start_run(wandb, run_id, id_file, kwargs)

    @property
    def run(self) -> Any:
        """The wandb run (for tables such as the completions log)."""
        return self._run

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        if self._run is None:
            return
        row = {k: v for k, v in ((k, _clean(v)) for k, v in metrics.items()) if v is not None}
        self._run.log(row, step=int(step))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _start_run(wandb: Any, run_id: str, id_file: Path, kwargs: dict[str, Any]) -> Any:
    """``wandb.init`` with the fallbacks of :class:`WandbLogger`; None when W&B cannot start."""
    try:
        return wandb.init(id=run_id, **kwargs)
    except Exception as exc:  # noqa: BLE001 - W&B raises many types; logging must not kill
        error = exc
    wandb.teardown()  # the failed attempt's W&B service still holds the run id
    if kwargs["mode"] == "online":
        log.warning(
            "W&B online init failed within %.0f s (%s); logging W&B offline to %s instead "
            "(upload later with `wandb sync`)",
            kwargs["settings"].init_timeout,
            _first_line(error),
            kwargs["dir"],
        )
        kwargs = {**kwargs, "mode": "offline"}
        try:
            return wandb.init(id=run_id, **kwargs)
        except Exception as exc:  # noqa: BLE001
            error = exc
        wandb.teardown()
    # e.g. "run ID in use" after a SIGKILL: continue in a new run of the same name and group.
    group = run_id.split("-r")[0]
    new_id = f"{group}-r{secrets.token_hex(2)}"
    log.warning(
        "W&B run %s could not be resumed (%s); logging to new run %s",
        run_id,
        _first_line(error),
        new_id,
    )
    try:
        run = wandb.init(id=new_id, group=group, **kwargs)
    except Exception as exc:  # noqa: BLE001
        wandb.teardown()
        log.warning(
            "W&B could not start (%s): no W&B logging for this run; metrics.jsonl holds every row",
            _first_line(exc),
        )
        return None
    fileio.write_text(id_file, new_id)
    return run


class TensorBoardLogger:
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``): one scalar per
    measured metric per step; names as in metrics.jsonl (``reward/mean`` ...).

    Needs the ``tensorboard`` package (ms-swift depends on it; ``pip install tensorboard``):
    a ConfigError naming ``metrics.tensorboard`` otherwise.
    """

    def __init__(self, log_dir: str | os.PathLike, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                f"config key 'metrics.tensorboard': needs the tensorboard package ({exc}); "
                "pip install tensorboard, or set metrics.tensorboard=false"
            ) from exc
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        # purge_step: a resumed run discards events of steps after the checkpoint
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        for name, value in sorted(metrics.items()):
            clean = _clean(value)
            if clean is not None:
                self._writer.add_scalar(name, float(clean), global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class ConsoleLogger:
    """tqdm progress bar: step, reward, raw ACR, tokens/s; an INFO line every ``log_every``."""

    def __init__(
        self, total_steps: int, initial_step: int = 0, log_every: int = 1, bar: bool = True
    ):
        self.log_every = log_every
        self._bar = None
        if bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                desc="grpo",
                unit="step",
                dynamic_ncols=True,
            )

    @staticmethod
    def summary(metrics: dict[str, float | None]) -> dict[str, str]:
        """The few figures worth a glance, formatted."""

        def fmt(key: str, spec: str) -> str:
            v = _clean(metrics.get(key))
            return "-" if v is None else format(v, spec)

        return {
            "reward": fmt("reward/mean", ".3f"),
            "acr_raw": fmt("collapse/acr_raw", ".2f"),
            "tok/s": fmt("perf/tokens_per_s", ".0f"),
        }

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        info = self.summary(metrics)
        if self._bar is not None:
            self._bar.set_postfix(info, refresh=False)
            self._bar.update(step - self._bar.n)
        if step % self.log_every == 0:
            log.info("step %d %s", step, " ".join(f"{k}={v}" for k, v in info.items()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class MultiLogger:
    """Fans one row out to several loggers."""

    def __init__(self, loggers: list[MetricLogger]):
        self.loggers = loggers

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        for lg in self.loggers:
            lg.log(step, metrics)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def build_logger(
    cfg: MetricsConfig,
    run_dir: str | os.PathLike,
    *,
    rank: int,
    name: str,
    total_steps: int,
    start_step: int = 0,
    config: dict | None = None,
) -> MetricLogger:
    """JSONL + W&B + TensorBoard (``metrics.tensorboard``) + console on rank 0 (rows after
    ``start_step`` dropped); NullLogger elsewhere."""
    if rank != 0:
        return NullLogger()
    run_dir = Path(run_dir)
    jsonl = JsonlLogger(run_dir / "metrics.jsonl")
    jsonl.truncate_after(start_step)
    loggers: list[MetricLogger] = [jsonl]
    if cfg.wandb_mode != "disabled":
        loggers.append(WandbLogger(cfg, run_dir, name, config))
    if cfg.tensorboard:
        tb_dir = Path(cfg.tensorboard_dir) if cfg.tensorboard_dir else run_dir / "tensorboard"
        loggers.append(TensorBoardLogger(tb_dir, purge_step=start_step + 1 if start_step else None))
    loggers.append(ConsoleLogger(total_steps, start_step, cfg.log_every, cfg.progress_bar))
    return MultiLogger(loggers)


def _metric_row(row: Any, where: str) -> dict:
    """``row`` when it is a metrics row: an object with an integer ``step`` whose values are
    numbers or null (DataError naming ``where`` and the key otherwise)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a metrics row must be a JSON object, got {type(row).__name__}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**53:
        raise DataError(f"{where}: 'step' must be an integer >= 0, got {step!r:.40}")
    for key, value in row.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DataError(f"{where}: '{key}' must be a number or null, got {value!r:.40}")
    return row


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All rows of a metrics.jsonl (a torn line, from a kill mid-write, is skipped with a
    warning). DataError naming file:line for a row that is not a metrics row (not an object,
    no integer ``step``, a value that is not a number) or JSON nobody could have torn (nested
    too deeply, an integer over 4,300 digits)."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for num, line in enumerate(fh, start=1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{num}"
            try:
                row = fileio.parse_json(line, where)
            except fileio.MalformedJson:
                log.warning("%s: skipping a torn line", where)
                continue
            rows.append(_metric_row(row, where))
    return rows
