"""`megagrpo eval` on the demo model (issue 12.5): predictions in IgakuQA's baseline_results
format that `megagrpo score` scores identically, 禁忌肢 counts, adapters applied exactly."""

from __future__ import annotations

import json
import shutil

import pytest

from megagrpo.cli import main
from megagrpo.errors import ConfigError


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_eval_predictions_score_identically(tmp_path, igakuqa_dir, repo_root, demo_model, capsys):
    exams = [igakuqa_dir / "2018" / "112-A.jsonl", igakuqa_dir / "2019" / "113-B.jsonl"]
    out = tmp_path / "preds"
    args = [
        "eval",
        str(repo_root / "configs" / "demo_cpu.yaml"),
        "rollout.engine=hf",
        "rollout.max_tokens=4",
        "rollout.max_model_len=2048",
        f"trainer.output_dir={tmp_path}",
        "--data",
        *map(str, exams),
        "--limit",
        "2",
        "--out",
        str(out),
        "--json",
    ]
    assert main(args) == 0
    got = _last_json(capsys.readouterr().out)
    assert got["predictions"] == str(out) and got["total"] == 4
    assert {"accuracy", "score", "total", "kinki_selected", "by_exam"} <= set(got)
    assert set(got["by_exam"]) == {"112-A", "113-B"}
    guess = got["guessing"]  # against guessing: the same count as the official scorer
    assert guess["questions"] == 4 and guess["correct"] == got["correct"]
    assert 0.0 <= guess["best_constant"] <= 1.0 and sum(guess["answers"].values()) == 1.0
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.jsonl"))
    assert files == ["2018/112-A_megagrpo.jsonl", "2019/113-B_megagrpo.jsonl"]
    baseline = json.loads(
        (igakuqa_dir / "baseline_results" / "2018" / "112-A_gpt4.jsonl").read_text().splitlines()[0]
    )
    rows = [json.loads(x) for x in (out / files[0]).read_text().splitlines()]
    assert [r["problem_id"] for r in rows] == ["112A1", "112A2"]
    assert all(set(r) == set(baseline) for r in rows)  # problem_id, prediction, explanation

    gold = tmp_path / "gold"  # the same question set as plain gold files
    for exam in exams:
        (gold / exam.parent.name).mkdir(parents=True, exist_ok=True)
        lines = exam.read_text(encoding="utf-8").splitlines()[:2]
        (gold / exam.parent.name / exam.name).write_text("\n".join(lines) + "\n")
        meta = exam.with_name(exam.stem + "_metadata.jsonl")
        shutil.copy(meta, gold / exam.parent.name / meta.name)
    assert main(["score", "--gold", str(gold), "--predictions", str(out), "--json"]) == 0
    scored = _last_json(capsys.readouterr().out)
    for key in ("accuracy", "score", "total", "points_total", "correct", "kinki_selected"):
        assert scored[key] == got[key], key
    assert scored["by_year"] == got["by_year"]


def test_kinki_counts_against_the_metadata(igakuqa_dir, capsys):
    """GPT-4's 2018 predictions: the 禁忌肢 count equals a direct count over the raw files."""
    pred_dir = igakuqa_dir / "baseline_results" / "2018"
    args = ["score", "--gold", str(igakuqa_dir / "2018"), "--predictions", str(pred_dir)]
    assert main([*args, "--predictions-glob", "*_gpt4.jsonl", "--json"]) == 0
    got = _last_json(capsys.readouterr().out)
    kinki = {}
    for meta in (igakuqa_dir / "2018").glob("*_metadata.jsonl"):
        for line in meta.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            letters = "".join(rec["kinki"]).translate(str.maketrans("ａｂｃｄｅ", "abcde"))
            kinki[rec["problem_id"]] = set(letters)
    expected = []
    for f in sorted(pred_dir.glob("*_gpt4.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            if set(rec["prediction"].split(",")) & kinki.get(rec["problem_id"], set()):
                expected.append(rec["problem_id"])
    assert got["kinki_selected"] == len(expected) and sorted(got["kinki_problems"]) == sorted(
        expected
    )
    assert sum(t["kinki_selected"] for t in got["by_exam"].values()) == len(expected)


def test_adapter_is_applied_exactly(tmp_path, demo_model):
    """--adapter: the engine's log-probs equal peft's on the same adapter (fp32)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megagrpo.commands.eval import apply_adapter
    from megagrpo.rollout import RolloutConfig, build_engine

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    peft_model = get_peft_model(
        base,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = list(range(100, 140))
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    engine = build_engine(
        RolloutConfig(engine="hf", max_model_len=256, max_tokens=8), str(demo_model)
    )
    try:
        before = torch.tensor(engine.sequence_logprobs(ids), dtype=torch.float64)
        info = apply_adapter(engine, tmp_path / "adapter", demo_model)
        after = torch.tensor(engine.sequence_logprobs(ids), dtype=torch.float64)
    finally:
        engine.close()
    assert info["applied"] and info["modules"] == 2 * 30  # q, v in 30 layers
    assert float((before - want).abs().max()) > 1e-2  # the adapter moves the model
    assert float((after - want).abs().max()) < 1e-4  # fp32 merge vs peft's unmerged forward


def test_step_names_the_checkpoints_and_refuses_per_rank_shards(tmp_path):
    """--step N exports the adapter of training checkpoint N (tests/distributed/
    test_reshard_resume.py runs it end to end); a missing step names the ones there are, and a
    checkpoint of per-rank shards (older format) says how to get an exportable one."""
    from megagrpo.commands.eval import step_adapter_dir
    from megagrpo.errors import CheckpointError

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    manifest = {"format": "megagrpo-train-ckpt-v2", "step": 2, "world_size": 1, "files": {}}
    (ckpt / "meta.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="step_000005.*have: \\['step_000002'\\]"):
        step_adapter_dir(run, 5, tmp_path / "out")
    with pytest.raises(CheckpointError, match="per-rank shards.*resume the run"):
        step_adapter_dir(run, 2, tmp_path / "out")
