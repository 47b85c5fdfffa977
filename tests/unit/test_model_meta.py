"""`megagrpo verify-model --meta` on the shipped Qwen3-235B-A22B config (no memory used)."""

from __future__ import annotations

import json
import os

from forkrun import run_cli  # tests/forkrun.py: forked from the preloaded server

PUBLISHED_TOTAL = 235_093_634_560  # HF num_parameters() of Qwen/Qwen3-235B-A22B


def test_meta_235b_one_rank_of_tp4_ep8_pp2(repo_root):
    cmd = [
        "verify-model",
        "--meta",
        "--hf-config",
        str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        "--tp",
        "4",
        "--ep",
        "8",
        "--pp",
        "2",
        "--json",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = run_cli(cmd, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout[out.stdout.index("{") :])
    assert rep["total_params"] == PUBLISHED_TOTAL
    assert 22.0e9 < rep["active_params"] < 22.4e9
    assert rep["world_size"] == 16 and rep["dp"] == 2 and rep["expert_dp"] == 1
    # independent closed form for rank 0 (first stage): 47 layers, 16 experts, vocab/4
    h, hd = 4096, 128
    attn = (h * hd * (64 + 8) + 64 * hd * h) // 4 + 2 * h + 2 * hd + 128 * h
    experts = 16 * 3 * h * 1536
    assert rep["rank_params"] == 47 * (attn + experts) + 151936 * h // 4
    assert rep["rank_bytes"] == 2 * rep["rank_params"]
    assert rep["hf_mapping_covers_rank"]
    assert rep["rank_lora_params"] > 0


def test_meta_rejects_layout_that_does_not_divide(repo_root):
    cmd = [
        "verify-model",
        "--meta",
        "--hf-config",
        str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        "--pp",
        "4",
        "--first-stage-layers",
        "20",
    ]
    out = run_cli(cmd, timeout=600)
    assert out.returncode == 2
    assert "74 middle layers do not divide over 3 middle stages" in out.stderr


def test_meta_235b_uneven_pp4_first_stage(repo_root):
    """94 layers on 4 stages (megatron-core's uneven pipeline): 25 + 23 + 23 + 23; rank 0
    of TP4 x EP8 x PP4 builds the first 25 (closed form as above)."""
    cmd = [
        "verify-model",
        "--meta",
        "--hf-config",
        str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        "--tp",
        "4",
        "--ep",
        "8",
        "--pp",
        "4",
        "--json",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = run_cli(cmd, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout[out.stdout.index("{") :])
    assert rep["layers_on_rank"] == 25 and rep["world_size"] == 32
    h, hd = 4096, 128
    attn = (h * hd * (64 + 8) + 64 * hd * h) // 4 + 2 * h + 2 * hd + 128 * h
    experts = 16 * 3 * h * 1536
    assert rep["rank_params"] == 25 * (attn + experts) + 151936 * h // 4
    assert rep["hf_mapping_covers_rank"]
