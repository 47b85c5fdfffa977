"""ms-swift flags for batching, optimisation, checkpoints, data, rewards and logging ->
megagrpo keys (the second half of :mod:`megagrpo.swift.flags`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError, not_utf8
from megagrpo.swift.flags import (
    DIFFERS,
    EXACT,
    HARMLESS,
    MATH_VERIFY_NOTE,
    MISSING,
    OPTIM_DEFAULTS,
    SWIFT_DEFAULTS,
    Translation,
    _bool,
    _default,
    _list,
)

MAX_TEXT_BYTES = 1 << 20
"""The largest ``--system`` file from-swift reads."""


def translate_optim(t: Translation) -> None:
    """Micro-batch size, optimizer, LR schedule, warm-up, checkpoints, evaluation (the batch
    layout: :mod:`megagrpo.swift.batching`)."""
    mb_flag = "micro_batch_size" if "micro_batch_size" in t.flags else "per_device_train_batch_size"
    mb = int(t.get(mb_flag, 1))
    t.add(mb_flag, EXACT, {"trainer.micro_batch_size": mb}, value=mb)
    for flag in ("lr", "learning_rate"):
        t.copy(flag, "trainer.lr", float)
    style_flag = "lr_decay_style" if t.flavor == "megatron" else "lr_scheduler_type"
    style = t.get("lr_decay_style", t.get("lr_scheduler_type", SWIFT_DEFAULTS["lr_schedule"]))
    supported, given = style in ("constant", "linear", "cosine"), style_flag in t.flags
    if not supported:
        note = f"'{style}' decay is not supported (constant | linear | cosine)"
    elif not given:
        note = f"not given: ms-swift's default {style} applied (megagrpo's default is constant)"
    else:
        note = ""
    t.add(
        style_flag,
        MISSING if not supported else EXACT if given else DIFFERS,
        {"trainer.lr_schedule": style} if supported else {},
        note,
        given=given,
        value=style,
    )
    for flag in ("lr_decay_style", "lr_scheduler_type"):
        if flag in t.flags and flag != style_flag:
            t.add(flag, EXACT if supported else MISSING, {}, "see " + style_flag)
    t.copy("min_lr", "trainer.min_lr", float)
    _steps_and_warmup(t)
    _default(
        t, "weight_decay", "trainer.weight_decay", OPTIM_DEFAULTS["weight_decay"], 0.0, cast=float
    )
    b1 = float(t.get("adam_beta1", OPTIM_DEFAULTS["adam_beta1"]))
    b2 = float(t.get("adam_beta2", OPTIM_DEFAULTS["adam_beta2"]))
    given = "adam_beta2" in t.flags
    t.add(
        "adam_beta2",
        EXACT if given else DIFFERS,
        {"trainer.adam_betas": [b1, b2]},
        ""
        if given
        else f"not given: ms-swift's default beta2 {b2} applied (megagrpo's default is 0.999)",
        given=given,
        value=b2,
    )
    if "adam_beta1" in t.flags:
        t.add("adam_beta1", EXACT, {"trainer.adam_betas": [b1, b2]})
    for flag in ("clip_grad", "max_grad_norm"):
        t.copy(flag, "trainer.grad_clip", float)
    _default(t, "seed", "trainer.seed", OPTIM_DEFAULTS["seed"], 0, cast=int)
    t.copy(
        "save_steps",
        "trainer.save_every",
        int,
        DIFFERS,
        "a megagrpo checkpoint is LoRA + optimizer state for --resume, not a PEFT adapter",
    )
    t.copy("save_total_limit", "trainer.keep_checkpoints", int)
    t.copy(
        "eval_steps",
        "trainer.eval_every",
        int,
        DIFFERS,
        "evaluates data.eval with the official IgakuQA rule (also `megagrpo eval`)",
    )


def _steps_and_warmup(t: Translation) -> None:
    t.copy("lr_warmup_iters", "trainer.warmup_steps", int)
    for flag in ("lr_warmup_fraction", "warmup_ratio"):
        t.copy(flag, "trainer.warmup_ratio", float)


def _weight(value: Any) -> float:
    """One ``--reward_weights`` entry as a finite number; ConfigError naming it."""
    try:
        weight = float(value)
    except (TypeError, ValueError, OverflowError):
        weight = float("nan")
    if isinstance(value, bool) or weight != weight or abs(weight) == float("inf"):
        raise ConfigError(f"--reward_weights {str(value)[:40]!r}: expected a number")
    return weight


def _columns(cols: Any) -> dict[str, str]:
    """``--columns`` (a JSON object of ``source: target`` names); ConfigError naming it."""
    if isinstance(cols, str):
        try:
            cols = json.loads(cols)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"--columns {cols[:60]!r}: not a JSON object ({exc})") from None
    if not isinstance(cols, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in cols.items()
    ):
        raise ConfigError(f"--columns: expected a JSON object of names, got {str(cols)[:60]!r}")
    return cols


def _text_file(path: Path) -> str:
    """A ``--system`` file's text; ConfigError naming it when unreadable or not UTF-8."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_TEXT_BYTES + 1)
        if len(data) > MAX_TEXT_BYTES:
            raise ConfigError(f"--system {path}: over {MAX_TEXT_BYTES >> 20} MiB, not a prompt")
        return data.decode("utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"--system {path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise not_utf8(path) from None


DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow")
"""File types ms-swift loads a local dataset from."""


def looks_like_path(name: str) -> bool:
    """A local dataset path rather than a hub id (``org/name``): absolute, ``./``, ``../``,
    ``~``, more than one ``/``, or a data file's suffix."""
    return (
        name.startswith(("/", "./", "../", "~"))
        or name.count("/") > 1
        or (name.lower().endswith(DATA_SUFFIXES))
    )


def translate_data_rewards(t: Translation, keep_swift_accuracy: bool) -> None:
    """Datasets, prompts, rewards, logging."""
    for flag, key in (("dataset", "data.train"), ("val_dataset", "data.eval")):
        if flag not in t.flags:
            continue
        local, remote, absent, unmounted = [], [], [], []
        for d in _list(t.get(flag)):
            path = str(d).split("#", 1)[0]
            if Path(path).expanduser().exists():
                local.append(str(d))
            elif path.endswith(".jsonl"):
                local.append(str(d))
                unmounted.append(path)
            elif looks_like_path(path):
                absent.append(str(d))
            else:
                remote.append(str(d))
        note = []
        if remote:
            note.append(f"hub datasets {remote}: download and convert to local JSONL first")
        if absent:
            note.append(
                f"{absent}: not found here (not mounted on this machine?); megagrpo reads "
                "local JSONL: convert it and give that file"
            )
        if unmounted:
            note.append(
                f"{unmounted}: not found here (not mounted on this machine?): written as given, "
                "read when `megagrpo train` starts"
            )
        sampled = any("#" in d for d in local)
        if sampled:
            note.append(
                "not supported: ms-swift's 'path#N' trains on N random rows; megagrpo would "
                "train on every row (write the N rows to a file)"
            )
        t.add(
            flag,
            MISSING if remote or absent or sampled else DIFFERS if unmounted else EXACT,
            {key: [d.split("#", 1)[0] for d in local]} if local else {},
            "; ".join(note),
        )
    if "columns" in t.flags:
        cols = _columns(t.get("columns"))
        t.add("columns", EXACT, {"data.columns": [f"{k}={v}" for k, v in cols.items()]})
    if "system" in t.flags:
        system = str(t.get("system"))
        path = Path(system).expanduser()
        if system.endswith(".txt") and path.is_file():
            t.add("system", EXACT, {"data.prompt.system": _text_file(path)}, f"read from {path}")
        elif system.endswith(".txt"):
            t.add(
                "system",
                MISSING,
                {},
                f"{path} not found here (ms-swift reads the file at start; without it megagrpo "
                "would train with the chat template's default system prompt): give the file "
                "(a path from here) or its text",
            )
        else:
            t.add("system", EXACT, {"data.prompt.system": system})
    t.copy("enable_thinking", "data.prompt.enable_thinking", _bool)
    t.copy("external_plugins", "rewards.external_plugins", lambda v: [str(p) for p in _list(v)])
    _rewards(t, keep_swift_accuracy)
    _logging(t)


def _rewards(t: Translation, keep_swift_accuracy: bool) -> None:
    names = [str(n) for n in _list(t.get("reward_funcs", []))]
    if not names:
        if "reward_weights" in t.flags:
            t.add("reward_weights", HARMLESS, {}, "no --reward_funcs: no function to weight")
        for flag in ("soft_cache_length", "soft_max_length"):
            if flag in t.flags:
                t.add(flag, HARMLESS, {}, "no effect without soft_overlong in reward_funcs")
        t.add(
            "reward_funcs",
            DIFFERS,
            {},
            "not given: megagrpo's default reward (mcq_accuracy) kept",
            given=False,
            value=[],
        )
        return
    weights = [_weight(w) for w in _list(t.get("reward_weights", [1.0] * len(names)))]
    models = len(_list(t.get("reward_model", [])))
    if models and len(weights) == len(names) + models:  # ms-swift: functions, then models
        weights = weights[: len(names)]
    if len(weights) != len(names):
        raise ConfigError(f"--reward_weights: {len(weights)} weights for {len(names)} reward_funcs")
    max_tokens = int(t.get("max_completion_length", SWIFT_DEFAULTS["max_completion_length"]))
    specs, notes = [], []
    for name, w in zip(names, weights):
        if name == "accuracy" and not keep_swift_accuracy:
            specs.append({"name": "mcq_accuracy", "weight": w, "label": "accuracy"})
            notes.append(MATH_VERIFY_NOTE)
        elif name == "soft_overlong":
            cache = t.get("soft_cache_length")
            if cache is None:
                raise ConfigError(
                    "--reward_funcs soft_overlong needs --soft_cache_length "
                    "(ms-swift asserts it too)"
                )
            max_len = int(t.get("soft_max_length", max_tokens))
            if max_len > max_tokens:
                _soft_overlong_beyond(t, max_len, int(cache), max_tokens)
                continue
            specs.append(
                {
                    "name": "soft_overlong",
                    "weight": w,
                    "kwargs": {"max_len": max_len, "cache_len": int(cache)},
                }
            )
            k = len(specs) - 1
            t.add("soft_cache_length", EXACT, {}, f"rewards.functions.{k}.kwargs.cache_len")
            given = "soft_max_length" in t.flags
            t.add(
                "soft_max_length",
                EXACT if given else DIFFERS,
                {},
                f"rewards.functions.{k}.kwargs.max_len = {max_len}"
                + ("" if given else " (not given: max_completion_length, as ms-swift does)"),
                given=given,
                value=max_len,
            )
        else:
            kwargs = {
                k: t.get(k)
                for k in t.flags
                if k.startswith(("repetition_", "cosine_")) and k != "repetition_penalty"
            }
            specs.append(
                {
                    "name": f"orms:{name}",
                    "weight": w,
                    "label": name,
                    **({"kwargs": kwargs} if kwargs and name in ("repetition", "cosine") else {}),
                }
            )
            notes.append(
                f"'{name}' runs ms-swift's own ORM through the plugin adapter "
                "(needs the swift extra"
                + (
                    ", or its --external_plugins file)"
                    if name not in ("format", "cosine", "repetition", "react_format", "accuracy")
                    else ")"
                )
            )
    t.add(
        "reward_funcs", DIFFERS if notes else EXACT, {"rewards.functions": specs}, "; ".join(notes)
    )
    if "reward_weights" in t.flags:
        t.add("reward_weights", EXACT, {}, "weight of each rewards.functions entry")
    for flag in ("soft_cache_length", "soft_max_length"):
        if flag in t.flags and flag not in t.done:
            t.add(
                flag,
                EXACT,
                {},
                "no effect without soft_overlong in reward_funcs (in ms-swift either)",
            )


def _soft_overlong_beyond(t: Translation, max_len: int, cache: int, max_tokens: int) -> None:
    """--soft_max_length above max_completion_length (ms-swift accepts it): completions stop
    at max_completion_length, so ms-swift's penalty starts at max_len - cache and its -1 is
    never reached. Identically 0 when max_completion_length <= max_len - cache: the term is
    left out (the same training); otherwise the cut ramp has no megagrpo equivalent."""
    start = max_len - cache
    zero = max_tokens <= start
    for flag in ("soft_max_length", "soft_cache_length"):
        t.add(
            flag,
            DIFFERS if zero else MISSING,
            {},
            (
                f"soft_max_length {max_len} > max_completion_length {max_tokens}: ms-swift's "
                f"penalty starts at {start} tokens, which no completion reaches, so its "
                "soft_overlong reward is 0 for every completion; the term is left out"
            )
            if zero
            else (
                f"not supported: soft_max_length {max_len} > max_completion_length "
                f"{max_tokens}: ms-swift's ramp from {start} tokens is cut at {max_tokens} "
                "(never -1); megagrpo's soft_overlong needs max_len <= rollout.max_tokens"
            ),
            value=t.get(flag),
        )


def _logging(t: Translation) -> None:
    if "report_to" in t.flags:
        to = [str(x) for x in _list(t.get("report_to"))]
        keys: dict[str, Any] = {
            "metrics.wandb_mode": "online" if "wandb" in to else "disabled",
            "metrics.tensorboard": "tensorboard" in to,
        }
        other = [x for x in to if x not in ("wandb", "tensorboard")]
        t.add(
            "report_to",
            DIFFERS if other or "wandb" in to else EXACT,
            keys,
            "; ".join(
                filter(
                    None,
                    [
                        "W&B online (megagrpo's default is offline)" if "wandb" in to else "",
                        f"{other}: no such backend (metrics.jsonl is always written)"
                        if other
                        else "",
                    ],
                )
            ),
        )
    for flag, key in (
        ("wandb_project", "metrics.wandb_project"),
        ("logging_steps", "metrics.log_every"),
    ):
        t.copy(flag, key)
    t.copy(
        "log_completions",
        "metrics.log_completions",
        _bool,
        note="RUN_DIR/completions.jsonl (+ a W&B table every metrics.completions_table_every)",
    )
