"""The step-time model users can trust (issue 21 item 5): each new term of `plan-memory` by
hand (MoE-LoRA decode speed, streamed adapter bytes, the loss head's memory, fp32 LoRA while
generating, pinned host memory per node), the throughput ladder (monotone, each rung moves
only its phases, the off-policy rung's overlap in closed form) and `--ladder` on the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from test_plan_phases import _two_node

from megagrpo.commands.plan_memory import plan_run
from megagrpo.plan.ladder import PHASES, TARGET_STEP_S, ladder, rungs
from megagrpo.plan.memory import FUSED_CHUNK_BYTES, GIB, memory_plan, shapes_of
from megagrpo.plan.scenario import Assumptions, Hardware, scenario_from_config
from megagrpo.plan.time import step_time


@pytest.fixture(scope="module")
def rows(repo_root, hf235):
    sc = scenario_from_config(_two_node(repo_root), hf235)
    return sc, ladder(sc, Assumptions(), Hardware())


def _generate(sc, a=None):
    a = a or Assumptions()
    return step_time(sc, a, Hardware(), memory_plan(sc, a))["phases"]["generate"]


def test_moe_lora_engine_decodes_at_the_assumed_speed(repo_root, hf235):
    """Same layout, same KV capacity: serving the adapter on the experts divides every decode
    step by moe_lora_decode_speed; merged weights (no LoRA served) do not."""
    sc = scenario_from_config(_two_node(repo_root), hf235)
    lora = _generate(sc)
    merged = _generate(sc.with_(weight_sync="merged"))
    assert lora["moe_lora_decode_speed"] == 0.74 and merged["moe_lora_decode_speed"] == 1.0
    assert lora["decode_s"] * 0.74 == pytest.approx(merged["decode_s"], rel=1e-12)
    slow = _generate(sc, Assumptions(moe_lora_decode_speed=0.45))
    assert slow["decode_s"] * 0.45 == pytest.approx(merged["decode_s"], rel=1e-12)


def test_shrinking_batch_bills_less_than_the_full_batch(repo_root, hf235):
    """Lengths spread below max_tokens: the batch shrinks, the decode costs less than the same
    steps at full batch; all completions max_tokens long (sigma 0): exactly the full batch."""
    sc = scenario_from_config(_two_node(repo_root), hf235)
    g = _generate(sc)
    assert g["decode_s"] < 0.7 * g["full_batch_decode_s"]
    assert g["decode_steps"] == pytest.approx(sc.max_tokens, abs=2)  # 768 draws: one is clipped
    full = _generate(sc, Assumptions(mean_completion_tokens=sc.max_tokens, completion_sigma=0))
    assert full["waves"] > 1  # 48 sequences of 4,426 tokens overflow the KV cache
    assert full["decode_steps"] == pytest.approx(full["waves"] * sc.max_tokens)
    # the same steps; context t per step against its mean (max_tokens / 2): ~1e-4 apart
    assert full["decode_s"] == pytest.approx(full["full_batch_decode_s"], rel=1e-3)


def test_streamed_adapter_sync_bytes_closed_form(repo_root, hf235):
    """Streamed: bf16 full factors all-reduced over the model-parallel groups (dense over
    tp x pp = 2, experts over ep x etp x pp = 16): 2 x bytes x (n - 1) / n each; the PEFT
    directory: 8 B per adapter parameter."""
    s = shapes_of(hf235)
    r = 32
    q, kv = s.heads * s.hd, s.kv * s.hd
    dense = s.layers * r * ((s.h + q + 2 * kv) + (q + s.h))  # qkv + proj
    expert = s.moe_layers * s.experts * r * ((s.h + 2 * s.moe_ffn) + (s.moe_ffn + s.h))
    assert expert == pytest.approx(4.93e9, rel=0.01)  # the 235B adapter is mostly experts
    p = plan_run(_two_node(repo_root), hf235)
    want = 2 * dense * 2 * (2 - 1) / 2 + 2 * expert * 2 * (16 - 1) / 16
    assert p["time"]["phases"]["sync"]["bytes_per_gpu"] == pytest.approx(want, rel=1e-12)
    old = plan_run(_two_node(repo_root, "trainer.adapter_transport=peft_dir"), hf235)
    assert old["time"]["phases"]["sync"]["bytes_per_gpu"] == pytest.approx(8 * (dense + expert))
    assert p["time"]["phases"]["sync"]["s"] < old["time"]["phases"]["sync"]["s"] / 5


def test_loss_head_memory_follows_fused_linear(repo_root, hf235):
    """loss.fused_linear: one 32 MiB logits chunk + fp32 [T, H] hidden gradient + 4 fp32 stats
    per token; without it the [T, V/TP] bf16 logits and their gradient."""
    s = shapes_of(hf235)
    tokens = 5120  # micro_batch_size 1 x max_model_len
    fused = plan_run(_two_node(repo_root), hf235)["breakdown_gib"]["logits"]
    want = (FUSED_CHUNK_BYTES + tokens * s.h * 4 + tokens * 16) / GIB
    assert fused == pytest.approx(want, abs=1e-3)
    full = plan_run(_two_node(repo_root, "loss.fused_linear=false"), hf235)
    assert full["breakdown_gib"]["logits"] == pytest.approx(tokens * s.vocab * 4 / GIB, abs=1e-3)


def test_pinned_host_memory_is_checked_per_node(repo_root, hf235):
    """The node's pinned buffers (8 GPUs x power-of-two rounded) against the host's memory."""
    cfg = _two_node(repo_root)
    ok = plan_run(cfg, hf235)
    assert ok["host"]["fits_node"] and ok["fits"]
    small = plan_run(cfg, hf235, hardware=Hardware(host_memory_gib_per_node=512))
    assert small["host"]["pinned_gib_per_node"] > 0.9 * 512
    assert not small["host"]["fits_node"] and not small["fits"]
    assert any("pinned host memory" in t for t in small["advice"])


def test_ladder_is_monotone_and_each_rung_moves_only_its_phases(rows):
    sc, table = rows
    names = [r["name"] for r in table]
    assert names == [r.name for r in rungs(sc)]
    declared = {r.name: r.phases for r in rungs(sc)}
    colocated = table[:4]  # baseline .. partial: colocated, phases in turn
    for prev, cur in zip(colocated, colocated[1:]):
        assert cur["step_s"] < prev["step_s"], cur["name"]
        for phase in PHASES:
            if phase in declared[cur["name"]]:
                assert cur["phases"][phase] <= prev["phases"][phase], (cur["name"], phase)
            else:
                assert cur["phases"][phase] == pytest.approx(prev["phases"][phase], rel=1e-12)
        moved = [k for k in PHASES if cur["phases"][k] != prev["phases"][k]]
        assert moved, cur["name"]
    for r in colocated:
        assert r["step_s"] == pytest.approx(sum(r["phases"].values()), rel=1e-12)
        assert r["fits"] and r["overlap_s"] == 0


def test_off_policy_rung_overlaps_generation_and_training(rows):
    """Separate placement: max(generate, train) + sync, no transitions; engines on one node,
    the trainer on the other, each within the headroom."""
    sc, table = rows
    off = table[-1]
    ph = off["phases"]
    assert off["changes"]["placement"] == "separate" and off["changes"]["rollout_gpus"] == 8
    assert ph["transitions"] == 0
    assert off["overlap_s"] == pytest.approx(min(ph["generate"], ph["train"]))
    assert off["step_s"] == pytest.approx(max(ph["generate"], ph["train"]) + ph["sync"])
    assert off["fits"] and max(off["phase_peak_gib"].values()) <= 0.9 * sc.gpu_memory_gib
    # the trainer on half the GPUs: at least twice the colocated compute
    assert ph["train"] > 2 * table[-2]["phases"]["train"] * 0.9


def test_partial_rung_uses_the_config_settings(repo_root, hf235):
    cfg = _two_node(
        repo_root, "rollout.partial.enabled=true", "rollout.partial.finish_fraction=0.5"
    )
    sc = scenario_from_config(cfg, hf235)
    assert sc.partial_finish_fraction == 0.5 and sc.partial_max_staleness == 2
    part = next(r for r in rungs(sc) if r.name == "+ partial rollouts")
    assert part.changes["partial_finish_fraction"] == 0.5
    g = _generate(sc)
    assert g["round_budget_tokens"] < sc.max_tokens and g["partial_chunks_s"] > 0
    assert g["s"] < _generate(dataclasses.replace(sc, partial_finish_fraction=0.0))["s"]


def _cli(repo_root, *extra):
    """``plan-memory --ladder`` of the 2-node config in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "megagrpo.cli",
        "plan-memory",
        str(repo_root / "configs/qwen3_235b_a22b_2node.yaml"),
        "--hf-config",
        str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        "--ladder",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_cli_ladder_table_and_json(repo_root, rows, capsys):
    from megagrpo.cli import main

    _, table = rows
    args = [
        "plan-memory",
        str(repo_root / "configs/qwen3_235b_a22b_2node.yaml"),
        "--hf-config",
        str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        "--ladder",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    for r in table:
        assert r["name"] in text and f"{r['step_s']:>7.1f}" in text
    assert f"target <= {TARGET_STEP_S:.0f} s/step" in text
    assert "generate" in text and "overlap" in text and "config as written" in text
    assert "vllm.fp8_moe_lora" in text and "without the blocked rungs" in text
    js = _cli(repo_root, "--json")  # a fresh process: nothing but JSON on stdout
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)  # the whole of stdout is one JSON object
    assert data["target_s"] == TARGET_STEP_S
    assert [r["name"] for r in data["rungs"]] == [r["name"] for r in table]
    assert data["rungs"][0]["step_s"] == pytest.approx(table[0]["step_s"])
    runnable = [r["name"] for r in data["runnable"]]  # FP8 and off-policy are blocked
    assert runnable == ["baseline", "+ streamed adapter sync", "+ partial rollouts"]
    # the config as written syncs streamed (the default): not the baseline's PEFT directory
    assert data["config"]["phases"]["sync"] < table[0]["phases"]["sync"] / 5
    assert data["config"]["phases"]["generate"] == pytest.approx(table[0]["phases"]["generate"])


def test_separate_placement_checks_the_engine_gpus(repo_root, hf235):
    """`rollout.placement: separate` as the trainer runs it today (one engine rank, TP 1):
    the whole 235B model on one H100 (bf16, ~438 GiB by hand: every parameter x 2 bytes)
    leaves no KV cache, so the plan says DOES NOT FIT and names the key, where it used to
    print FITS from the colocated phases; the same placement with the engine on 8 GPUs
    (the ladder's rung) fits."""
    cfg = _two_node(repo_root, "rollout.placement=separate", "rollout.load_format=auto")
    sc = scenario_from_config(cfg, hf235)
    assert sc.placement == "separate" and sc.rollout_gpus == 1
    p = plan_run(cfg, hf235)
    eng = p["engine_gpus"]
    params = 235e9  # Qwen3-235B-A22B: ~235 B parameters, all on the engine's one GPU
    assert eng["weights_gib_per_gpu"] == pytest.approx(params * 2 / GIB, rel=0.05)
    assert eng["kv_tokens_per_replica"] == 0 and not eng["fits"] and not p["fits"]
    assert any("rollout.placement=separate" in t for t in p["advice"])
    from megagrpo.plan.search import full_plan

    wide = full_plan(sc.with_(rollout_gpus=8, vllm_tp=8), Assumptions(), Hardware())
    assert wide["engine_gpus"]["fits"] and wide["engine_gpus"]["kv_tokens_per_replica"] > 0
