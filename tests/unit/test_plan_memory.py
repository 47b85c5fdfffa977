"""`megagrpo plan-memory` and the Slurm dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megagrpo.commands.plan_memory import plan_run as plan
from megagrpo.config.loader import load_config
from megagrpo.model.arch import arch_from_hf, param_counts
from megagrpo.plan.memory import GIB
from megagrpo.trainer.config import RunConfig


def _cfg(repo_root, *overrides):
    return load_config(RunConfig, [repo_root / "configs/qwen3_235b_a22b.yaml"], list(overrides))


def test_unsharded_weights_equal_the_parameter_count(repo_root, hf235):
    """1 GPU, no parallelism: base weights = every parameter in bf16 (closed form count)."""
    cfg = _cfg(
        repo_root,
        "cluster.num_nodes=1",
        "cluster.gpus_per_node=1",
        "parallel.tp=1",
        "parallel.ep=1",
        "parallel.pp=1",
        "parallel.sequence_parallel=false",
    )
    total = param_counts(arch_from_hf(hf235))["total"]
    assert 230e9 < total < 240e9
    got = plan(cfg, hf235)["breakdown_gib"]["base_weights"] * GIB
    assert got == pytest.approx(total * 2, rel=2e-3)
    assert plan(cfg, hf235)["fits"] is False


def test_shipped_layout_fits_h100_and_sharding_scales(repo_root, hf235):
    p = plan(_cfg(repo_root), hf235)
    assert p["fits"] and p["num_gpus"] == 128 and p["per_gpu_gib"] <= 0.95 * 80
    half = plan(_cfg(repo_root, "parallel.ep=4"), hf235)
    # experts dominate: halving EP nearly doubles the per-GPU base weights
    assert 1.7 < half["breakdown_gib"]["base_weights"] / p["breakdown_gib"]["base_weights"] < 2.0
    bad = plan(_cfg(repo_root, "cluster.num_nodes=1", "parallel.ep=8"), hf235)
    assert not bad["fits"] and bad["advice"]


def test_cli_json_and_error(repo_root, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megagrpo.cli",
            "plan-memory",
            str(repo_root / "configs/qwen3_235b_a22b.yaml"),
            "--hf-config",
            str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"fits", "num_gpus", "per_gpu_gib"} <= set(data)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megagrpo.cli",
            "plan-memory",
            str(repo_root / "configs/qwen3_235b_a22b.yaml"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2 and "--hf-config" in out.stderr


def test_slurm_dry_run_prints_per_node_commands_and_plan(repo_root):
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    out = subprocess.run(
        ["bash", str(repo_root / "slurm/grpo_235b.sh"), "trainer.max_steps=5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=repo_root,
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[h100-node")]
    assert len(lines) == 16
    for rank, line in enumerate(lines):
        assert f"--node-rank={rank} " in line and "--nnodes=16" in line
        assert "--nproc-per-node=8" in line and "trainer.max_steps=5" in line
        assert "-m megagrpo.cli train configs/qwen3_235b_a22b.yaml" in line
    assert "FITS" in out.stdout and "NCCL_IB_HCA" in out.stdout


def test_lora_activations_are_counted(repo_root, hf235):
    """Issue 11 item 10: adapter inputs are planned, in the activation dtype (bf16), for every
    layer without recompute and for one layer with ``model.recompute=full``. Closed form for
    the shipped layout (TP4 + SP, EP32, ETP1, one 5120-token micro-batch, rank 32, targets
    qkv/proj/fc1/fc2; all 94 layers MoE, top-8): per layer and token, qkv input h (gathered
    over the sequence), proj input 64*128/4, experts 5120/4*8 routed copies / 5120 tokens
    = 2 copies of h (fc1) and of 1536 (fc2); 2 bytes each, plus 32 fp32 values per row."""
    h, tokens = 4096, 5120
    width = h + 64 * 128 / 4 + 2 * (h + 1536)
    rows = 1 + 1 + 2 * 2
    per_layer = tokens * (width * 2 + rows * 32 * 4)
    old = ("parallel.tp=4", "parallel.ep=32", "parallel.pp=1")  # the closed form's layout
    full = plan(_cfg(repo_root, *old), hf235)
    none = plan(_cfg(repo_root, *old, "model.recompute=none"), hf235)
    assert full["breakdown_gib"]["lora_activations"] == pytest.approx(per_layer / GIB, abs=0.01)
    assert none["breakdown_gib"]["lora_activations"] == pytest.approx(
        94 * per_layer / GIB, rel=1e-3
    )
    # TE's flash attention keeps no [s, s] scores: without recompute every layer's ~70 KB per
    # token (SP over TP4, 8 routed copies) and adapter inputs stay; the local spec adds 5 a s
    assert none["phase_peak_gib"]["train"] > full["phase_peak_gib"]["train"] + 40
    local = plan(_cfg(repo_root, *old, "model.recompute=none", "model.spec=local"), hf235)
    assert local["phase_peak_gib"]["train"] > full["phase_peak_gib"]["train"] + 200
    drop = plan(_cfg(repo_root, *old, "model.recompute=none", "model.lora.dropout=0.05"), hf235)
    assert drop["breakdown_gib"]["lora_activations"] > 2 * none["breakdown_gib"]["lora_activations"]
