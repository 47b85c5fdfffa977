"""Resharding resume and usable checkpoints (issue 15.7), end to end with `megagrpo train`.

Run A: 2 gloo ranks, EP2 (experts split, dense layers data-parallel), tiny Qwen3-MoE, HF
engine, 3 steps, a checkpoint after every step. Run B: A's run directory without its step-3
checkpoint, resumed by ONE process (``parallel.ep=1``): the layout-free checkpoint of step 2
is resharded (every rank file memory-mapped, each expert's adapter and moments copied into the
1-rank layout), and step 3 runs again.

"Continuing identically where the math allows": step 3's rollouts depend only on the restored
state (LoRA bit for bit -> the same merged engine weights -> the same tokens under the same
per-problem seeds, rewards, sampler decisions), so reward/length/sampler figures are equal
exactly; the loss, entropy and grad norm are the same math reduced in another order (EP2's
expert all-to-all and the DP all-reduce vs one process), so they agree to rel 1e-4, the bound
the layout parity tests use (fp32 with a few hundred terms per reduction: ~1e-6 observed).
The LoRA state written after step 3 agrees within 256 ulps of its scale.

Then the step-2 checkpoint (written by 2 ranks) is exported without Megatron: the PEFT
adapter loads in peft, and its forward equals transformers' on the merged export (fp32, 1e-4);
and `megagrpo eval --step 2` evaluates that checkpoint end to end (adapter applied, verified).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megagrpo.metrics import read_metrics
from megagrpo.testing import assert_close_scaled, tiny_run_config, write_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _config(path: Path, model_dir: Path, out: Path, name: str, **parallel) -> Path:
    cfg = tiny_run_config(
        model_dir,
        out,
        name,
        parallel=parallel,
        rollout={"max_tokens": 5},
        trainer={
            "max_steps": 3,
            "batch_groups": 2,
            "micro_batch_size": 4,
            "save_every": 1,
            "keep_checkpoints": 3,
            "grad_clip": 0.0,
            "export_adapter": False,
        },
    )
    return write_run_config(path, cfg)


@pytest.fixture(scope="module")
def runs(tiny_moe_dir, tmp_path_factory):
    from test_train_distributed import _run  # same folder (pytest rootdir import)

    out = tmp_path_factory.mktemp("reshard")
    _run(_config(out / "a.yaml", tiny_moe_dir, out, "a", ep=2), 2)
    shutil.copytree(out / "a", out / "b")
    shutil.rmtree(out / "b" / "checkpoints" / "step_000003")
    _run(_config(out / "b.yaml", tiny_moe_dir, out, "b"), 1, extra=["--resume"])
    return out


def test_resume_on_one_rank_continues_the_two_rank_run(runs):
    a = read_metrics(runs / "a" / "metrics.jsonl")
    b = read_metrics(runs / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3] and b[:2] == a[:2]  # rows 1-2: A's, kept
    ra, rb = a[2], b[2]
    assert rb["train/skipped_empty_batch"] == 0.0
    for key in ("reward/mean", "reward/mean_raw", "length/gen_mean", "dynamic/valid_groups"):
        assert rb[key] == ra[key], key
    for key in ("loss/policy", "loss/entropy", "train/grad_norm"):
        assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), key
    manifest = json.loads((runs / "b" / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert manifest["world_size"] == 1 and manifest["lora_layout"] == "hf-pieces"


def test_state_after_the_resumed_step_matches(runs, tiny_moe_dir):
    from megagrpo.commands.export import read_checkpoint
    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.hf_mapping import hf_weight_shapes
    from megagrpo.model.lora_state import Units

    shapes = hf_weight_shapes(arch_from_hf(load_hf_config(tiny_moe_dir)))
    units = []
    for run in ("a", "b"):
        _, pieces = read_checkpoint(runs / run / "checkpoints" / "step_000003")
        units.append(Units(pieces, shapes, 4))
    ua, ub = units
    assert ua.index.keys() == ub.index.keys()
    for name, factor in ua.index:
        for what in ("param", "exp_avg", "exp_avg_sq"):
            assert_close_scaled(
                ub.get(name, factor, what), ua.get(name, factor, what), 256, f"{name} {what}"
            )


def test_two_rank_checkpoint_exports_an_adapter_peft_loads(runs, tiny_moe_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megagrpo.cli import main

    run = str(runs / "a")
    assert main(["export", run, "--step", "2", "--adapter", "--out", str(tmp_path / "ad")]) == 0
    assert main(["export", run, "--step", "2", "--merged", "--out", str(tmp_path / "m")]) == 0
    ids = torch.arange(3, 40).unsqueeze(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "ad")).eval()
        adapted = peft_model(input_ids=ids).logits
        merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
        merged = merged_model.eval()(input_ids=ids).logits
    assert float((adapted - plain).abs().max()) > 1e-3  # the trained adapter moves the model
    assert float((adapted - merged).abs().max()) < 1e-4
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["r"] == 4 and "mlp.experts.gate_up_proj" in config["target_parameters"]


def test_eval_step_uses_the_training_checkpoint(runs, tiny_moe_dir, igakuqa_dir, capsys):
    from megagrpo.cli import main

    args = [
        "eval",
        str(runs / "a.yaml"),
        "rollout.max_model_len=1024",
        "rollout.max_tokens=4",
        "--data",
        str(igakuqa_dir / "2018" / "112-A.jsonl"),
        "--limit",
        "2",
        "--step",
        "2",
        "--json",
    ]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["total"] == 2 and "step 2" in got["adapter"]
    assert got["sync"]["applied"] and got["sync"]["verified"]
    assert Path(got["predictions"]) == runs / "a" / "eval" / "step_000002"
