"""The throughput ladder (issue 32 items 3-4): every rung through the real compatibility gate,
the TP 8 rung apart from FP8, the off-policy rung in closed form (first round overlapped,
resampling rounds not), low / central / high bands, `--ladder` on the CLI; and the terms of
issue 21 that stay (streamed adapter bytes, the loss head's memory, pinned host memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_plan_phases import _two_node

from megagrpo.commands.plan_memory import config_of, make_gate, plan_run
from megagrpo.gate import compat
from megagrpo.plan.collapse import billed, collapse_bill
from megagrpo.plan.gate import EXACT, REFUSED, UNVERIFIED
from megagrpo.plan.ladder import PHASES, TARGETS, ladder_report, rungs
from megagrpo.plan.memory import FUSED_CHUNK_BYTES, GIB, shapes_of
from megagrpo.plan.scenario import Assumptions, Hardware, scenario_from_config


@pytest.fixture(scope="module")
def report(repo_root, hf235):
    cfg = _two_node(repo_root)
    sc = billed(scenario_from_config(cfg, hf235), collapse_bill(cfg))
    return cfg, sc, ladder_report(sc, Assumptions(), Hardware(), gate=make_gate(cfg, hf235))


def test_streamed_adapter_sync_bytes_closed_form(repo_root, hf235):
    """Streamed: bf16 attention factors all-reduced over the model-parallel group (tp x pp = 2:
    2 x bytes x (n - 1) / n), each expert's factors reduced to the ranks whose engine holds it
    over ep x etp x pp = 16 (scale-audit-3 finding 9: bytes x (n - 1) / n); the PEFT directory:
    8 B per adapter parameter."""
    s = shapes_of(hf235)
    r = 32
    q, kv = s.heads * s.hd, s.kv * s.hd
    dense = s.layers * r * ((s.h + q + 2 * kv) + (q + s.h))  # qkv + proj
    expert = s.moe_layers * s.experts * r * ((s.h + 2 * s.moe_ffn) + (s.moe_ffn + s.h))
    assert expert == pytest.approx(4.93e9, rel=0.01)  # the 235B adapter is mostly experts
    p = plan_run(_two_node(repo_root), hf235)
    want = 2 * dense * 2 * (2 - 1) / 2 + expert * 2 * (16 - 1) / 16
    assert p["time"]["phases"]["sync"]["bytes_per_gpu"] == pytest.approx(want, rel=1e-12)
    old = plan_run(_two_node(repo_root, "trainer.adapter_transport=peft_dir"), hf235)
    assert old["time"]["phases"]["sync"]["bytes_per_gpu"] == pytest.approx(8 * (dense + expert))
    assert p["time"]["phases"]["sync"]["s"] < old["time"]["phases"]["sync"]["s"] / 5


def test_loss_head_memory_follows_fused_linear(repo_root, hf235):
    """loss.fused_linear: one logits chunk (1,024 rows of bf16 logits at least: issue 31 P2;
    32 MiB at most TP's) + fp32 [T, H] hidden gradient + 4 fp32 stats per token; without it
    the [T, V/TP] bf16 logits and their gradient."""
    s = shapes_of(hf235)
    tokens = 5120  # micro_batch_size 1 x max_model_len
    cfg = _two_node(repo_root)
    fused = plan_run(cfg, hf235)["breakdown_gib"]["logits"]
    chunk = max(FUSED_CHUNK_BYTES, 1024 * s.vocab / cfg.parallel.tp * 2)
    want = (chunk + tokens * s.h * 4 + tokens * 16) / GIB
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


def test_host_memory_comes_from_the_config(repo_root, hf235):
    """P1: ``cluster.host_memory_gib`` is the node's memory the plan checks (the shipped
    configs say 2048, a DGX H100); a node too small for the pinned buffers is flagged,
    naming the key."""
    cfg = _two_node(repo_root)
    assert cfg.cluster.host_memory_gib == 2048
    pinned = plan_run(cfg, hf235)["host"]["pinned_gib_per_node"]
    small = plan_run(_two_node(repo_root, f"cluster.host_memory_gib={pinned * 0.8:.0f}"), hf235)
    assert not small["host"]["fits_node"] and not small["fits"]
    assert any("cluster.host_memory_gib" in t for t in small["advice"])
    roomy = plan_run(_two_node(repo_root, f"cluster.host_memory_gib={pinned * 2:.0f}"), hf235)
    assert roomy["host"]["fits_node"]


def test_each_rung_moves_only_its_phases(report):
    _, sc, rep = report
    table = rep["rungs"]
    assert [r["name"] for r in table] == [r.name for r in rungs(sc)]
    declared = {r.name: r.phases for r in rungs(sc)}
    colocated = [r for r in table if r["overlap_s"] == 0]
    for prev, cur in zip(colocated, colocated[1:]):
        for phase in PHASES:
            if phase not in declared[cur["name"]]:
                assert cur["phases"][phase] == pytest.approx(prev["phases"][phase], rel=1e-12)
        assert any(cur["phases"][k] != prev["phases"][k] for k in PHASES), cur["name"]
    for r in colocated:
        assert r["step_s"] == pytest.approx(sum(r["phases"].values()), rel=1e-12)
        b = r["bounds"]
        assert b["best"] <= b["low"] <= b["central"] == r["step_s"] <= b["high"] <= b["worst"]
    # streamed sync and partial rollouts each make the config's step faster
    by = {r["name"]: r["step_s"] for r in table}
    assert by["+ streamed adapter sync"] < by["baseline"]
    assert by["+ partial rollouts"] < by["+ streamed adapter sync"]


def test_tp8_rung_is_bf16_and_separate_from_fp8(report):
    """scale-audit-2 section 4 item 8: the TP 8 per node rung is bf16 (an exact lever of its
    own) and FP8 comes after it; the exact ladder keeps it whatever the FP8 verdict."""
    _, _, rep = report
    rows = {r["name"]: r for r in rep["rungs"]}
    tp8 = rows["+ vLLM TP 8 per node"]
    assert tp8["changes"]["vllm_tp"] == 8 and tp8["changes"]["replicas"] == "independent"
    assert "quantization" not in tp8["changes"] and tp8["status"] == EXACT
    assert "+ vLLM TP 8 per node" in [r["name"] for r in rep["exact"]]
    assert all(r["status"] == EXACT for r in rep["exact"])


def test_fp8_rung_status_is_the_gates_verdict(report, hf235):
    """The FP8 rung's status is compat.check_run's on the rung's layout (not restated): refused
    naming the rule while the gate refuses FP8 + MoE LoRA, unverified once it allows it."""
    cfg, _, rep = report
    fp8 = next(r for r in rep["rungs"] if r["name"] == "+ FP8 rollout")
    layout = config_of(cfg, fp8_scenario(report))
    found = compat.check_run(layout, hf235, world=16)
    if found:
        assert fp8["status"] == REFUSED
        assert all(v.rule.name in fp8["note"] for v in found)
        assert "+ FP8 rollout" not in [r["name"] for r in rep["unverified"]]
    else:
        assert fp8["status"] == UNVERIFIED and "unverified on GPU" in fp8["note"]


def fp8_scenario(report):
    """The cumulative scenario of the FP8 rung."""
    _, sc, _ = report
    cur = sc
    for rung in rungs(sc):
        cur = cur.with_(**rung.changes)
        if rung.name == "+ FP8 rollout":
            return cur
    raise AssertionError("no FP8 rung")


def test_off_policy_rung_closed_form(report):
    """Separate placement one step ahead: the next step's first round overlaps training, the
    further rounds of dynamic sampling do not: max(round, train) + (rounds - 1) round + sync;
    no transitions; engines on a whole node, the trainer on the other."""
    _, sc, rep = report
    off = rep["rungs"][-1]
    assert off["name"] == "+ one-step off-policy"
    ph, rounds = off["phases"], off["rounds_per_step"]
    assert rounds == sc.rounds_per_step > 1  # the collapse bill
    first, round_s = off["first_round_s"], off["round_s"]
    assert ph["generate"] == pytest.approx(first + (rounds - 1) * round_s)
    assert off["changes"]["placement"] == "separate" and off["changes"]["rollout_gpus"] == 8
    assert ph["transitions"] == 0
    assert off["overlap_s"] == pytest.approx(min(first, ph["train"]))
    want = max(first, ph["train"]) + (rounds - 1) * round_s + ph["sync"]
    assert off["step_s"] == pytest.approx(want)
    assert "rollout.partial.enabled=true" in off["overrides"]  # it stacks on partial rollouts
    assert "rollout.max_staleness=1" in off["overrides"]


def test_partial_rung_uses_the_config_settings(repo_root, hf235):
    cfg = _two_node(
        repo_root, "rollout.partial.enabled=true", "rollout.partial.finish_fraction=0.5"
    )
    sc = scenario_from_config(cfg, hf235)
    assert sc.partial_finish_fraction == 0.5 and sc.partial_max_staleness == 2
    part = next(r for r in rungs(sc) if r.name == "+ partial rollouts")
    assert part.changes["partial_finish_fraction"] == 0.5


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


def test_cli_ladder_table_and_json(repo_root, report, capsys):
    from megagrpo.cli import main

    _, _, rep = report
    args = [
        "plan-memory",
        str(repo_root / "configs/qwen3_235b_a22b_2node.yaml"),
        "--hf-config",
        str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        "--ladder",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    for r in rep["rungs"]:
        assert r["name"] in text and f"{r['step_s']:>7.1f}" in text
    assert "best exact:" in text and "best unverified:" in text
    assert f"target <= {TARGETS[16][EXACT]:.0f} s/step" in text
    assert "collapse" in text and "generation rounds" in text and "low-high" in text
    js = _cli(repo_root, "--json", "--levels", "L1=10,L2=10,L3=10,L4=10,L5=10,L6=10")
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)  # the whole of stdout is one JSON object
    assert data["targets"] == {k: v for k, v in TARGETS[16].items()}
    assert [r["name"] for r in data["rungs"]] == [r["name"] for r in rep["rungs"]]
    assert data["collapse"]["source"].startswith("--levels L1=10")
    for r in data["rungs"]:
        assert set(r["bounds"]) == {"low", "central", "high", "best", "worst"}


def test_fp8_rung_is_unverified_once_the_gate_allows_it(repo_root, hf235, monkeypatch):
    """With the gate's FP8 rule lifted (the GPU-path change: allowed, unverified on GPU) the
    FP8 rung is unverified, not refused: in the unverified ladder, not in the exact one."""
    rules = tuple(r for r in compat.RULES if r.name != "vllm.fp8_moe_lora")
    monkeypatch.setattr(compat, "RULES", rules)
    cfg = _two_node(repo_root)
    sc = billed(scenario_from_config(cfg, hf235), collapse_bill(cfg))
    rep = ladder_report(sc, Assumptions(), Hardware(), gate=make_gate(cfg, hf235))
    fp8 = next(r for r in rep["rungs"] if r["name"] == "+ FP8 rollout")
    assert fp8["status"] == UNVERIFIED and "unverified on GPU" in fp8["note"]
    assert "+ FP8 rollout" in [r["name"] for r in rep["unverified"]]
    assert "+ FP8 rollout" not in [r["name"] for r in rep["exact"]]
    off = rep["rungs"][-1]  # stacks on FP8: unverified too
    assert off["status"] == UNVERIFIED
