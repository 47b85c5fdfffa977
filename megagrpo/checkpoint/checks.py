"""What a checkpoint's content must be, beyond matching its manifest's checksums.

The checksums catch damage, not a file written wrong (or edited and re-hashed): these checks
say why a checkpoint cannot be used, so :func:`megagrpo.checkpoint.format.find_resume_checkpoint`
skips it like a damaged one and ``megagrpo export`` refuses it, naming the file.

- ``trainer.json``: an object whose ``step`` is the manifest's step (an integer), with
  ``sampler`` and ``dynamic`` objects (required when a run resumes; ``loop`` an object too).
- layout-free LoRA pieces (:mod:`megagrpo.model.lora_state`): each a ``name``, a factor ``A``
  / ``B``, ``bounds`` ``[[start, stop], [start, stop]]`` with ``0 <= start < stop``, a
  floating-point ``param`` of exactly the bounds' shape and finite, optimiser ``state``
  tensors of the same shape (or scalars), finite; over every rank file, the pieces of one unit
  tile a box from ``[0, 0]`` exactly once (no overlap, no hole). That the box is the unit's
  full shape is checked when the pieces are assembled against the model
  (:class:`megagrpo.model.lora_state.Units`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from megagrpo.checkpoint.values import trainer_state_errors

Box = tuple[str, str, tuple[tuple[int, int], ...]]
"""``(name, factor, ((start, stop), ...))`` of one piece."""


TRAINER_KEYS = ("sampler", "dynamic")
"""What a run's ``trainer.json`` holds besides ``step`` (the resume of a run requires them)."""


def problem_count(manifest: Any) -> int | None:
    """The training set's size a checkpoint's manifest records (None: not recorded)."""
    problems = manifest.get("problems") if isinstance(manifest, dict) else None
    count = problems.get("count") if isinstance(problems, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def check_trainer_state(
    state: Any,
    step: Any,
    where: str,
    required: tuple[str, ...] = (),
    num_problems: int | None = None,
    vocab: int | None = None,
) -> str | None:
    """Why ``trainer.json``'s ``state`` cannot be resumed at manifest step ``step``, or None;
    ``required``: keys that must hold objects (others, when present, must too). The values
    are checked field by field (:mod:`megagrpo.checkpoint.values`; ``num_problems``: the
    training set's size, ``vocab``: the model's vocabulary, when known)."""
    if not isinstance(state, dict):
        return f"{where}: expected a JSON object, got {type(state).__name__}"
    saved = state.get("step")
    if not isinstance(saved, int) or isinstance(saved, bool):
        return f"{where}: 'step' must be an integer, got {saved!r}"
    if saved != step:
        return f"{where}: 'step' is {saved}, the manifest says {step!r}"
    for key in (*TRAINER_KEYS, "loop"):
        if (key in required or key in state) and not isinstance(state.get(key), dict):
            return f"{where}: '{key}' must be an object, got {str(state.get(key))[:60]!r}"
    why = trainer_state_errors(state, num_problems, vocab)
    return f"{where}: {why}" if why else None


def _bounds(value: Any) -> tuple[tuple[int, int], ...] | None:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    out = []
    for span in value:
        ok = isinstance(span, (list, tuple)) and len(span) == 2
        if not ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in span):
            return None
        if not 0 <= span[0] < span[1]:
            return None
        out.append((int(span[0]), int(span[1])))
    return tuple(out)


def _check_piece(piece: Any, where: str) -> tuple[str | None, Box | None]:
    if not isinstance(piece, dict):
        return f"{where}: not a piece ({type(piece).__name__})", None
    name, factor = piece.get("name"), piece.get("factor")
    if not isinstance(name, str) or factor not in ("A", "B"):
        return f"{where}: needs a 'name' and a factor A or B, got {name!r} {factor!r}", None
    where = f"{where} ({name} {factor})"
    bounds = _bounds(piece.get("bounds"))
    if bounds is None:
        return f"{where}: bounds {piece.get('bounds')!r} are not two [start, stop) spans", None
    shape = tuple(e - s for s, e in bounds)
    param = piece.get("param")
    if not isinstance(param, torch.Tensor) or not param.is_floating_point():
        return f"{where}: 'param' is not a floating-point tensor", None
    if tuple(param.shape) != shape:
        return f"{where}: param shape {list(param.shape)} != bounds shape {list(shape)}", None
    if not torch.isfinite(param).all():
        return f"{where}: param holds NaN or inf", None
    state = piece.get("state", {})
    if not isinstance(state, dict):
        return f"{where}: 'state' is not an object", None
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            return f"{where}: state '{key}' is not a tensor", None
        if value.dim() and tuple(value.shape) != shape:
            return f"{where}: state '{key}' shape {list(value.shape)} != {list(shape)}", None
        if value.is_floating_point() and not torch.isfinite(value).all():
            return f"{where}: state '{key}' holds NaN or inf", None
    return None, (name, factor, bounds)


def check_pieces(pieces: Iterable[Any], where: str) -> tuple[list[str], list[Box]]:
    """``(reasons, boxes)`` of one rank file's pieces (at most 3 reasons are kept)."""
    reasons: list[str] = []
    boxes: list[Box] = []
    for i, piece in enumerate(pieces):
        why, box = _check_piece(piece, f"{where}: piece {i}")
        if why is not None:
            reasons.append(why)
            if len(reasons) >= 3:
                break
        elif box is not None:
            boxes.append(box)
    return reasons, boxes


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    return all(sa < eb and sb < ea for (sa, ea), (sb, eb) in zip(a, b, strict=True))


def check_tiling(boxes: Iterable[Box]) -> list[str]:
    """Why the pieces of some unit do not tile a box from the origin exactly once."""
    units: dict[tuple[str, str], list[tuple[tuple[int, int], ...]]] = {}
    for name, factor, bounds in boxes:
        units.setdefault((name, factor), []).append(bounds)
    reasons = []
    for (name, factor), spans in sorted(units.items()):
        lo = [min(b[d][0] for b in spans) for d in range(2)]
        hi = [max(b[d][1] for b in spans) for d in range(2)]
        volume = sum(math.prod(e - s for s, e in b) for b in spans)
        overlap = any(_overlap(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :])
        if overlap or lo != [0, 0] or volume != math.prod(hi):
            what = "overlap (written twice)" if overlap else "leave a hole (a piece is missing)"
            reasons.append(f"pieces of {factor} for '{name}' {what}: bounds {sorted(spans)}")
            if len(reasons) >= 3:
                break
    return reasons


def check_content(
    path: Any,
    names: list[str],
    manifest: dict[str, Any],
    load: Any,
    layout_free: bool,
    required: tuple[str, ...] = (),
) -> tuple[list[str], list[Box]]:
    """``(reasons, boxes)`` for the files ``names`` of checkpoint ``path`` (already matching
    the manifest): ``trainer.json`` and, for a ``layout_free`` checkpoint, the pieces of each
    rank file (``load(file)`` reads one, weights-only). CheckpointError from ``load`` is a
    reason too. The boxes go to :func:`check_tiling` once every rank's are gathered."""
    import json

    from megagrpo.errors import CheckpointError

    reasons: list[str] = []
    boxes: list[Box] = []
    for name in names:
        file = path / name
        if name == "trainer.json":
            try:
                state = json.loads(file.read_bytes())
            except (OSError, ValueError, RecursionError) as exc:
                reasons.append(f"{name}: unreadable ({exc})")
                continue
            count = problem_count(manifest)
            why = check_trainer_state(state, manifest.get("step"), name, required, count)
            reasons += [why] if why else []
        elif layout_free and name.startswith("rank") and name.endswith(".pt"):
            try:
                state = load(file)
            except CheckpointError as exc:
                reasons.append(str(exc))
                continue
            pieces = state.get("pieces") if isinstance(state, dict) else None
            if not isinstance(pieces, list):
                reasons.append(f"{name}: holds no layout-free LoRA pieces")
                continue
            why_pieces, mine = check_pieces(pieces, name)
            reasons += why_pieces
            boxes += mine
    return reasons, boxes
