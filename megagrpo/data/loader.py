"""Problem sets: IgakuQA exam files and ms-swift style JSONL, read into :class:`Problem`.

Formats (detected per line):

* IgakuQA ``data/YEAR/EXAM-BLOCK.jsonl``: ``problem_id``, ``problem_text``, ``choices``,
  ``answer`` (list of letters, or one digit string for numeric questions), ``points``,
  ``text_only``. ``EXAM-BLOCK_metadata.jsonl`` beside it is joined for ``human_accuracy``
  and ``category``; ``*_translate.jsonl`` siblings and ``baseline_results/`` are ignored
  when a directory is given.
* ms-swift JSONL, in any of its three row formats: ``messages`` (system/user turns);
  ``query`` / ``response`` (+ optional ``system``, ``history`` as ``[[query, response], ...]``);
  sharegpt ``conversations`` (``{from: human|gpt|system, value}``). A trailing assistant turn
  is dropped from the prompt. The gold is ``solution`` (else ``answer``, else that trailing
  assistant turn), parsed by :func:`megagrpo.data.gold.parse_gold` (``"c"``, ``"c,d"``,
  ``"<answer> b </answer>"``, ``"答え: b"`` ...). A gold that is not option letters or numbers
  is kept as free text in ``meta['solution']`` (for plugin rewards) with an empty ``answer``,
  and counted in ``ProblemList.free_text_gold``. Optional ``id``, else ``<file stem>:<line>``.
  ``columns`` renames keys first (ms-swift ``--columns``: ``{"answer": "solution"}``).

Errors name the file and line. Nothing is silently dropped: a deliberate skip (image
questions with ``exclude_images``) is counted in ``ProblemList.skipped`` and logged.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from megagrpo import fileio
from megagrpo.data.config import PromptConfig
from megagrpo.data.gold import check_choice_letters, igakuqa_gold, parse_gold
from megagrpo.data.prompts import render_messages
from megagrpo.data.variants import parse_variants
from megagrpo.errors import DataError, not_utf8
from megagrpo.types import Problem

log = logging.getLogger(__name__)

_SIBLING = re.compile(r"_(metadata|translate)\.jsonl$")
_CHOOSE = re.compile(r"([2-9２-９二三四])\s*つ選べ")
_KANJI_NUM = {"二": 2, "三": 3, "四": 4}
_FULLWIDTH = str.maketrans(
    "ａｂｃｄｅｆｇｈＡＢＣＤＥＦＧＨ０１２３４５６７８９", "abcdefghabcdefgh0123456789"
)


class ProblemList(list):
    """A ``list[Problem]`` that also records deliberate skips (``skipped[reason] = [ids]``) and
    the problems whose gold is free text (``free_text_gold``: ids)."""

    def __init__(self, items: Iterable[Problem] = ()):
        super().__init__(items)
        self.skipped: dict[str, list[str]] = {}
        self.free_text_gold: list[str] = []


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_ROW_KEYS = ("messages", "conversations", "query", "response", "system", "history")


def iter_jsonl_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand files and directories (recursive) into data files, sorted, siblings excluded."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            for f in sorted(p.rglob("*.jsonl")):
                rel = f.relative_to(p).parts
                if _SIBLING.search(f.name) or "baseline_results" in rel:
                    continue
                out.append(f)
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"no such file or directory: {p}")
    return out


def read_jsonl(
    path: str | os.PathLike, truncated_last_ok: bool = False
) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, record)``; a malformed line (bad JSON, not UTF-8, not an object)
    raises DataError naming file:line. ``truncated_last_ok``: a last line that is not JSON (a
    write cut short: an interrupted profile) ends the records with a warning instead."""
    with open(path, encoding="utf-8") as fh:
        try:
            lines = enumerate(fh, start=1)
            ahead = next(lines, None)
            while ahead is not None:
                num, line = ahead
                ahead = next(lines, None)
                if not line.strip():
                    continue
                try:
                    rec = fileio.parse_json(line, f"{path}:{num}")
                except DataError:
                    if truncated_last_ok and ahead is None:
                        log.warning("%s:%d: truncated last line ignored", path, num)
                        return
                    raise
                if not isinstance(rec, dict):
                    raise DataError(
                        f"{path}:{num}: expected a JSON object, got {type(rec).__name__}"
                    )
                yield num, rec
        except UnicodeDecodeError:
            raise not_utf8(path) from None


# Fields whose JSON type a format relies on: key -> (allowed types, what the error says).
_FieldTypes = dict[str, tuple[tuple[type, ...], str]]
_IGAKUQA_TYPES: _FieldTypes = {
    "answer": ((list, str, type(None)), "a list of option letters"),
    "choices": ((list, type(None)), "a list of option texts"),
}
_SOLUTION = ((list, str, int, float, type(None)), 'a string like "c" or "c,d" (or a list)')
_SWIFT_TYPES: _FieldTypes = {
    "messages": ((list,), "a list of {role, content} objects"),
    "choices": ((list, type(None)), "a list of option texts"),
    "solution": _SOLUTION,
    "answer": _SOLUTION,
}
_INT_TEXT = re.compile(r"\s*[+-]?\d*\s*")


def _check_field_types(rec: dict, where: str) -> None:
    """DataError naming file:line and the key when a known field has the wrong JSON type."""
    igakuqa = "problem_text" in rec and "problem_id" in rec  # the dispatch of load_problems
    for key, (types, what) in (_IGAKUQA_TYPES if igakuqa else _SWIFT_TYPES).items():
        value = rec.get(key)
        if key in rec and (not isinstance(value, types) or isinstance(value, bool)):
            raise DataError(
                f"{where}: '{key}' must be {what}, got {type(value).__name__} {value!r:.60}"
            )
    points = rec.get("points")
    if points is not None and (
        isinstance(points, bool)
        or not isinstance(points, (int, str))
        or (isinstance(points, str) and not _INT_TEXT.fullmatch(points))
    ):
        raise DataError(f"{where}: 'points' must be an integer, got {points!r:.60}")


def _normalise_answer(items: Iterable[str]) -> list[str]:
    return [str(a).strip().translate(_FULLWIDTH).lower() for a in items if str(a).strip()]


def _load_metadata(data_file: Path) -> dict[str, dict]:
    meta_file = data_file.with_name(data_file.stem + "_metadata.jsonl")
    if not meta_file.is_file():
        return {}
    out = {}
    for num, rec in read_jsonl(meta_file):
        acc = rec.get("human_accuracy")
        if acc not in (None, ""):
            try:
                float(acc)
            except (TypeError, ValueError):
                raise DataError(
                    f"{meta_file}:{num}: 'human_accuracy' must be a number, got {acc!r:.60}"
                ) from None
        if "problem_id" in rec:
            out[rec["problem_id"]] = rec
    return out


def _year_of(path: Path, exam: str) -> int | None:
    if re.fullmatch(r"(19|20)\d\d", path.parent.name):
        return int(path.parent.name)
    m = re.match(r"(\d{3})", exam)
    return int(m.group(1)) + 1906 if m else None  # 112th exam = 2018


def _igakuqa_problem(
    rec: dict, where: str, path: Path, meta: dict, prompt: PromptConfig
) -> Problem:
    pid = str(rec["problem_id"])
    choices = list(rec.get("choices") or [])
    if not rec.get("answer"):
        raise DataError(f"{where}: problem {pid} has no answer")
    answer = igakuqa_gold(rec["answer"], len(choices), f"{where}: problem {pid}")
    text = str(rec.get("problem_text", ""))
    m = _CHOOSE.search(text)
    num_choose = (_KANJI_NUM.get(m.group(1)) or int(m.group(1).translate(_FULLWIDTH))) if m else 1
    try:
        points = int(str(rec.get("points", "1")).strip() or 1)
    except ValueError as exc:
        raise DataError(
            f"{where}: problem {pid} has non-integer points {rec.get('points')!r}"
        ) from exc
    exam = path.stem
    extra = meta.get(pid, {})
    acc = extra.get("human_accuracy")
    return Problem(
        id=pid,
        messages=render_messages(text, choices, prompt),
        answer=answer,
        meta={
            "choices": choices,
            "points": points,
            "text_only": bool(rec.get("text_only", True)),
            "year": _year_of(path, exam),
            "exam": exam,
            "num_choose": num_choose,
            "numeric": not choices,
            "question": text,
            "source": where,
            "human_accuracy": float(acc) if acc not in (None, "") else None,
            "category": extra.get("category"),
        },
    )


def _remap(rec: dict, columns: dict[str, str], where: str) -> dict:
    """Rename keys ``{source: target}`` (ms-swift ``--columns``)."""
    if not columns:
        return rec
    out = {k: v for k, v in rec.items() if k not in columns}
    for src, dst in columns.items():
        if src not in rec:
            continue
        if dst in out:
            raise DataError(f"{where}: data.columns renames '{src}' to '{dst}', which exists")
        out[dst] = rec[src]
    return out


def _turn(m: object, where: str) -> dict:
    if not isinstance(m, dict):
        raise DataError(f"{where}: a turn must be an object, got {type(m).__name__}")
    if "from" in m and "value" in m:  # sharegpt
        role = _SHAREGPT_ROLES.get(str(m["from"]))
        if role is None:
            raise DataError(f"{where}: unknown sharegpt speaker {m['from']!r}")
        return {"role": role, "content": m["value"]}
    if "role" not in m or "content" not in m:
        raise DataError(f"{where}: turns must be {{role, content}} (or sharegpt {{from, value}})")
    return m


def _row_messages(rec: dict, where: str) -> list[dict]:
    """Chat turns of an ms-swift row in any of its formats (trailing assistant turn kept)."""
    if "messages" in rec or "conversations" in rec:
        raw = rec.get("messages", rec.get("conversations"))
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: 'messages'/'conversations' must be a non-empty list")
        return [_turn(m, where) for m in raw]
    messages = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
    history = rec.get("history") or []
    if not isinstance(history, list):
        raise DataError(f"{where}: 'history' must be [[query, response], ...]")
    for pair in history:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise DataError(f"{where}: 'history' must be [[query, response], ...]")
        messages += [
            {"role": "user", "content": pair[0]},
            {"role": "assistant", "content": pair[1]},
        ]
    messages.append({"role": "user", "content": rec["query"]})
    if rec.get("response") not in (None, ""):
        messages.append({"role": "assistant", "content": rec["response"]})
    return messages


def _swift_problem(rec: dict, where: str, path: Path, num: int, prompt: PromptConfig) -> Problem:
    messages = _row_messages(rec, where)
    trailing = None
    while messages and messages[-1]["role"] == "assistant":
        trailing = messages.pop()["content"]
    if not messages:
        raise DataError(f"{where}: no prompt turns left after dropping the assistant turn")
    if prompt.system != "default" and prompt.system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": prompt.system})
    solution = rec.get("solution", rec.get("answer", trailing))
    pid = str(rec.get("id", rec.get("problem_id", f"{path.stem}:{num}")))
    if solution in (None, "", []):
        raise DataError(f"{where}: problem {pid} has no 'solution' (nor answer/response)")
    gold = parse_gold(solution)
    drop = (*_ROW_KEYS, "solution", "answer", "id")
    meta = {k: v for k, v in rec.items() if k not in drop}
    meta.setdefault("choices", [])
    try:
        points = int(meta.get("points", 1))
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: problem {pid} has non-integer points") from exc
    meta.update(source=where, points=points, solution=solution)
    if "variants" in rec:
        meta["variants"] = parse_variants(rec["variants"], messages, where)
    answer = _normalise_answer(gold) if gold is not None else []
    if meta["choices"]:  # as IgakuQA files: a gold outside the choices is unsolvable
        check_choice_letters(answer, len(meta["choices"]), f"{where}: problem {pid}")
    return Problem(id=pid, messages=messages, answer=answer, meta=meta)


def load_problems(
    paths: Iterable[str | os.PathLike],
    *,
    exclude_images: bool = False,
    prompt: PromptConfig | None = None,
    columns: dict[str, str] | None = None,
) -> ProblemList:
    """Read problems from files/directories (see module docstring).

    Args:
        paths: files or directories (searched recursively for ``*.jsonl``).
        exclude_images: skip IgakuQA questions with ``text_only: false`` (counted).
        prompt: prompt templates and chat-template kwargs; defaults to the built-in
            Japanese prompt. Non-empty chat-template kwargs are stored in every problem's
            ``meta['chat_template_kwargs']`` (read by :func:`megagrpo.data.prompts.prompt_ids`).
        columns: rename record keys first, ``{source: target}`` (``data.columns``).
    Returns:
        ProblemList in file order; ``.skipped`` maps reason -> problem ids;
        ``.free_text_gold`` lists problems whose gold is not letters or numbers.
    Raises:
        DataError: malformed line (file:line), missing answer (problem id), duplicate id.
    """
    prompt = prompt or PromptConfig()
    template_kwargs = prompt.template_kwargs()
    problems = ProblemList()
    seen: dict[str, str] = {}
    for path in iter_jsonl_files(paths):
        meta = _load_metadata(path)
        for num, rec in read_jsonl(path):
            where = f"{path}:{num}"
            rec = _remap(rec, columns or {}, where)
            _check_field_types(rec, where)
            if "problem_text" in rec and "problem_id" in rec:
                prob = _igakuqa_problem(rec, where, path, meta, prompt)
            elif any(k in rec for k in ("messages", "conversations", "query")):
                prob = _swift_problem(rec, where, path, num, prompt)
            else:
                raise DataError(
                    f"{where}: unknown record format (keys: {sorted(rec)}); expected "
                    "IgakuQA (problem_id, problem_text, answer) or ms-swift (messages | "
                    "query/response | conversations, + solution); rename keys with data.columns"
                )
            if prob.id in seen:
                raise DataError(
                    f"{where}: duplicate problem id {prob.id} (first at {seen[prob.id]})"
                )
            seen[prob.id] = where
            if exclude_images and not prob.meta.get("text_only", True):
                problems.skipped.setdefault("image", []).append(prob.id)
                continue
            if template_kwargs:
                prob.meta["chat_template_kwargs"] = dict(template_kwargs)
            if not prob.answer:
                problems.free_text_gold.append(prob.id)
            problems.append(prob)
    for reason, ids in problems.skipped.items():
        log.info("skipped %d problems (%s), e.g. %s", len(ids), reason, ids[:3])
    if problems.free_text_gold:
        log.warning(
            "%d problems have a free-text solution (not option letters or numbers), e.g. %s: "
            "mcq_accuracy counts them as reward errors; score them with a plugin reward that "
            "reads 'solution'",
            len(problems.free_text_gold),
            problems.free_text_gold[:3],
        )
    return problems
