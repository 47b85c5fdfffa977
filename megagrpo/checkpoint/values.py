"""The values of a checkpoint's ``trainer.json``, field by field, before anything loads them.

Checksums catch damage; a file written wrong, or edited and re-hashed, passed the type checks
of :mod:`megagrpo.checkpoint.checks` and crashed the resume after the model was built
(``sampler.succ`` cut short: ValueError; ``sampler.rng.main = "abc"``: TypeError; a carried
token id of 10^9: IndexError), or was taken silently (a carried group whose ``logprobs`` are
shorter than its tokens, a walk position past its permutation). :func:`trainer_state_errors`
returns why, naming the field (``sampler.succ``, ``dynamic.carry[0].token_ids[1][4]``), so
the resume falls back to the checkpoint before, as for a damaged file.

What is checked: the curriculum sampler (version, one ``[epoch, pos]`` per walk with
``pos`` inside the pool, a generator state per stream, the per-problem arrays of the problem
set's length with values in range), carried groups (dynamic sampling's carry, the rollout
budget's top-ups, partial rollouts' pending groups, a generated batch between mini-batches):
every per-completion list as long as the group, token ids inside the vocabulary (when known:
the model's ``vocab_size``; before the model is known any non-negative 32-bit id), finite
log-probs <= 0, finite rewards; the loop's counters; a generated batch's progress (``done``
steps of ``mini_batches x epochs``, consistent with the step it was generated at and the
checkpoint's), ``prepared`` and ``layout`` (red team 4, N6); the engines' sync-verification
states (a count, probe log-probs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

MAX_ID = 2**31
"""Token ids are int32 in every engine and the trainer's embedding."""

_GROUP_KEYS = {
    "problem", "completions", "token_ids", "logprobs", "rewards", "lengths", "prompt_ids",
    "finish_reasons", "reward_parts", "meta", "routing", "member_variants", "member_prompt_ids",
}  # fmt: skip
_PENDING_KEYS = {
    "problem", "size", "prompt_ids", "token_ids", "logprobs", "versions", "finish", "started",
}  # fmt: skip


class Bad(Exception):
    """A field that cannot be resumed (the message names it)."""


def _int(value: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(f"{where}: expected an integer, got {str(value)[:40]!r}")
    if value < lo or (hi is not None and value >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise Bad(f"{where}: {value} is outside {bound}")
    return value


def _num(value: Any, where: str, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Bad(f"{where}: expected a number, got {str(value)[:40]!r}")
    if not math.isfinite(value) or value > hi:
        raise Bad(f"{where}: {value} is not a finite number{f' <= {hi}' if hi < 1e300 else ''}")
    return float(value)


def _list(value: Any, where: str, length: int | None = None) -> list:
    if not isinstance(value, list):
        raise Bad(f"{where}: expected a list, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise Bad(f"{where}: {len(value)} entries, expected {length}")
    return value


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise Bad(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _each(values: list, where: str, check: Callable[[Any, str], Any]) -> None:
    for i, v in enumerate(values):
        check(v, f"{where}[{i}]")


def _ids(value: Any, where: str, vocab: int) -> None:
    _each(_list(value, where), where, lambda v, w: _int(v, w, 0, vocab))


def _problem(value: Any, where: str) -> None:
    d = _dict(value, where)
    if not isinstance(d.get("id"), str):
        raise Bad(f"{where}.id: expected a string, got {str(d.get('id'))[:40]!r}")
    _each(_list(d.get("messages"), f"{where}.messages"), f"{where}.messages", _dict)
    _list(d.get("answer"), f"{where}.answer")
    _dict(d.get("meta", {}), f"{where}.meta")
    unknown = set(d) - {"id", "messages", "answer", "meta"}
    if unknown:
        raise Bad(f"{where}: unknown field(s) {sorted(unknown)}")


def _record(value: Any, where: str, keys: set[str]) -> dict:
    """A carried group's object: no field outside ``keys``, a valid ``problem``."""
    d = _dict(value, where)
    unknown = set(d) - keys
    if unknown:
        raise Bad(f"{where}: unknown field(s) {sorted(unknown)}")
    _problem(d.get("problem"), f"{where}.problem")
    return d


def _token_rows(d: dict, where: str, size: int, vocab: int) -> list:
    """``d["token_ids"]``: ``size`` rows of ids inside the vocabulary."""
    tokens = _list(d.get("token_ids"), f"{where}.token_ids", size)
    _each(tokens, f"{where}.token_ids", lambda v, w: _ids(v, w, vocab))
    return tokens


def _per_member(d: dict, key: str, where: str, size: int, item: Callable[[Any, str], Any]):
    """``d[key]``: empty or one entry per member, each checked by ``item``."""
    values = _list(d.get(key, []), f"{where}.{key}")
    if values:
        _list(values, f"{where}.{key}", size)
        _each(values, f"{where}.{key}", item)
    return values


def check_group(value: Any, where: str, vocab: int = MAX_ID) -> None:
    """A :class:`~megagrpo.types.Group` as ``dataclasses.asdict`` wrote it (routing aside)."""
    d = _record(value, where, _GROUP_KEYS)
    size = len(_list(d.get("completions"), f"{where}.completions"))
    _each(d["completions"], f"{where}.completions", lambda v, w: _str(v, w))
    tokens = _token_rows(d, where, size, vocab)
    logprobs = _list(d.get("logprobs"), f"{where}.logprobs", size)
    for i, (lps, toks) in enumerate(zip(logprobs, tokens)):
        w = f"{where}.logprobs[{i}]"
        _list(lps, w, len(toks))
        _each(lps, w, lambda v, w2: _num(v, w2, hi=1e-3))
    _per_member(d, "rewards", where, size, _num)
    lengths = _per_member(d, "lengths", where, size, _int)
    for i, (n, toks) in enumerate(zip(lengths, tokens)):
        if n != len(toks):
            raise Bad(f"{where}.lengths[{i}]: {n}, but token_ids[{i}] holds {len(toks)}")
    _ids(d.get("prompt_ids", []), f"{where}.prompt_ids", vocab)
    _per_member(d, "finish_reasons", where, size, _str)
    for name, values in _dict(d.get("reward_parts", {}), f"{where}.reward_parts").items():
        w = f"{where}.reward_parts.{name}"
        _each(_list(values, w, size), w, lambda v, w2: v is None or _num(v, w2))
    _dict(d.get("meta", {}), f"{where}.meta")
    if _list(d.get("routing", []), f"{where}.routing"):
        raise Bad(f"{where}.routing: routing is kept in the rank files, not trainer.json")
    _per_member(d, "member_variants", where, size, lambda v, w: _int(v, w, -1))
    _per_member(d, "member_prompt_ids", where, size, lambda v, w: _ids(v, w, vocab))


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise Bad(f"{where}: expected a string, got {type(value).__name__}")
    return value


def check_pending(value: Any, where: str, vocab: int = MAX_ID) -> None:
    """A partial rollout's :class:`~megagrpo.placement.partial.PendingGroup`."""
    d = _record(value, where, _PENDING_KEYS)
    size = _int(d.get("size"), f"{where}.size", 1)
    _ids(d.get("prompt_ids", []), f"{where}.prompt_ids", vocab)
    tokens = _token_rows(d, where, size, vocab)
    for key, item in (("logprobs", lambda v, w: _num(v, w, hi=1e-3)), ("versions", _int)):
        rows = _list(d.get(key), f"{where}.{key}", size)
        for i, (row, toks) in enumerate(zip(rows, tokens)):
            _each(_list(row, f"{where}.{key}[{i}]", len(toks)), f"{where}.{key}[{i}]", item)
    _each(_list(d.get("finish"), f"{where}.finish", size), f"{where}.finish", _str)
    if not isinstance(d.get("started", False), bool):
        raise Bad(f"{where}.started: expected true or false")


def _rng_state(value: Any, where: str) -> None:
    """A numpy ``bit_generator.state``: ``{"bit_generator": name, "state": {...}, ...}``."""
    d = _dict(value, where)
    if not isinstance(d.get("bit_generator"), str):
        raise Bad(f"{where}.bit_generator: expected a generator name")
    for key, inner in _dict(d.get("state"), f"{where}.state").items():
        if isinstance(inner, list):
            _each(inner, f"{where}.state.{key}", lambda v, w: _int(v, w, 0, 2**128))
        else:
            _int(inner, f"{where}.state.{key}", 0, 2**128)


def check_sampler(state: Any, where: str, num_problems: int | None) -> None:
    """The curriculum sampler's :meth:`state_dict` for ``num_problems`` problems (None:
    lengths only compared with each other)."""
    d = _dict(state, where)
    if d.get("version") != 1:
        raise Bad(f"{where}.version: {d.get('version')!r}, expected 1")
    _str(d.get("fingerprint"), f"{where}.fingerprint")
    arrays = {
        "succ": lambda v, w: _num(v, w) >= 0 or _neg(w),
        "fail": lambda v, w: _num(v, w) >= 0 or _neg(w),
        "streak": _int,
        "retired": _bool,
        "num_observed": _int,
    }
    n = num_problems
    for key, item in arrays.items():
        values = _list(d.get(key), f"{where}.{key}", n)
        n = len(values) if n is None else n
        _each(values, f"{where}.{key}", item)
    for stream, walks in _dict(d.get("walks"), f"{where}.walks").items():
        w = f"{where}.walks.{stream}"
        for i, walk in enumerate(_list(walks, w)):
            epoch, pos = _list(walk, f"{w}[{i}]", 2)
            _int(epoch, f"{w}[{i}][0] (epoch)", 0, 2**62)
            _int(pos, f"{w}[{i}][1] (position)", 0, (n or 0) + 1)
    for stream, rng in _dict(d.get("rng"), f"{where}.rng").items():
        _rng_state(rng, f"{where}.rng.{stream}")


def _neg(where: str) -> bool:
    raise Bad(f"{where}: a count below 0")


def _bool(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise Bad(f"{where}: expected true or false, got {str(value)[:40]!r}")


def _dynamic(state: Any, where: str, vocab: int) -> None:
    d = _dict(state, where)
    _each(_list(d.get("carry", []), f"{where}.carry"), f"{where}.carry", _group(vocab))
    if "budget" in d:
        b = _dict(d["budget"], f"{where}.budget")
        for i, item in enumerate(_list(b.get("pending", []), f"{where}.budget.pending")):
            w = f"{where}.budget.pending[{i}]"
            _int(_dict(item, w).get("step"), f"{w}.step")
            check_group(item.get("group"), f"{w}.group", vocab)


def _group(vocab: int) -> Callable[[Any, str], None]:
    return lambda v, w: check_group(v, w, vocab)


GENERATED_VERSION = 1
"""The format of a generated batch saved between two of its mini-batches."""


def _generated(state: Any, where: str, vocab: int, step: Any) -> None:
    """A generated batch saved at loop step ``step`` between two of its optimiser steps
    (:func:`megagrpo.trainer.minibatch.state_dict`): each loop step is one optimiser step on
    it, so the batch of step ``g`` has ``done = step - g + 1`` of its ``mini_batches x
    epochs`` behind it, at least one and not all."""
    d = _dict(state, where)
    if d.get("version", GENERATED_VERSION) != GENERATED_VERSION:
        raise Bad(f"{where}.version: {str(d.get('version'))[:40]!r}, expected 1")
    groups = _list(d.get("groups"), f"{where}.groups")
    _each(groups, f"{where}.groups", _group(vocab))
    adv = _list(d.get("adv"), f"{where}.adv", len(groups))
    for i, (a, g) in enumerate(zip(adv, groups)):
        _each(_list(a, f"{where}.adv[{i}]", len(g["completions"])), f"{where}.adv[{i}]", _num)
    total = 1
    for key in ("mini_batches", "epochs"):
        total *= _int(d.get(key), f"{where}.{key}", 1, 2**31)
    done = _int(d.get("done"), f"{where}.done", 1, total)
    at = _int(step, "step", 1)
    made = _int(d.get("step"), f"{where}.step", 1, at + 1)
    if done != at - made + 1:
        raise Bad(
            f"{where}.done: {done} optimiser steps on the batch of step {made}, but the "
            f"checkpoint is at step {at} (expected {at - made + 1})"
        )
    _bool(d.get("prepared"), f"{where}.prepared")
    layout = _dict(d.get("layout"), f"{where}.layout")
    _int(layout.get("world_size"), f"{where}.layout.world_size", 1, 2**31)
    for key, value in layout.items():
        if value is not None and not isinstance(value, bool | int | float | str):
            raise Bad(f"{where}.layout.{key}: expected a number, got {type(value).__name__}")


def _sync(state: Any, where: str) -> None:
    """The engines' sync-verification states (:meth:`SyncVerifier.state_dict` each, or null
    for an engine that keeps none): a count and probe log-probs of one length."""
    states = _list(_dict(state, where).get("verifiers"), f"{where}.verifiers")
    for i, v in enumerate(states):
        if v is None:
            continue
        w = f"{where}.verifiers[{i}]"
        d = _dict(v, w)
        _int(d.get("syncs"), f"{w}.syncs", 0, 2**62)
        size = len(_list(d.get("last_probe"), f"{w}.last_probe"))
        for key in ("last_probe", "ref_engine", "ref_trainer", "last_expected"):
            if d.get(key) is not None or key == "last_probe":
                probe = _list(d.get(key), f"{w}.{key}", size)
                _each(probe, f"{w}.{key}", lambda x, w2: _num(x, w2, hi=1e-3))


def trainer_state_errors(
    state: Mapping[str, Any], num_problems: int | None = None, vocab: int | None = None
) -> str | None:
    """Why the values of ``trainer.json``'s ``state`` cannot be resumed (naming the field), or
    None. ``num_problems``: the training set's size (the sampler's arrays); ``vocab``: the
    model's vocabulary (token ids), when known."""
    vocab = vocab or MAX_ID
    try:
        if "sampler" in state:
            check_sampler(state["sampler"], "sampler", num_problems)
        if "dynamic" in state:
            _dynamic(state["dynamic"], "dynamic", vocab)
        if "partial" in state:
            p = _dict(state["partial"], "partial")
            pending = _list(p.get("pending", []), "partial.pending")
            _each(pending, "partial.pending", lambda v, w: check_pending(v, w, vocab))
        if "loop" in state:
            _int(_dict(state["loop"], "loop").get("nonfinite_streak", 0), "loop.nonfinite_streak")
        if "sync" in state:
            _sync(state["sync"], "sync")
        if state.get("generated"):
            _generated(state["generated"], "generated", vocab, state.get("step"))
    except Bad as exc:
        return str(exc)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a shape not foreseen
        return f"unreadable ({type(exc).__name__}: {exc})"
    return None
