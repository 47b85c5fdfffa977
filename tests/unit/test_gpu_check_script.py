"""Control flow of scripts/gpu_check.sh on CPU: one JSON summary, every part recorded, a
failing part does not stop the others, the time budget skips what would start too late."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PARTS = [
    "env",
    "wheels",
    "imports",
    "gpu_tests",
    "bench_loss",
    "tiny_model",
    "train",
    "train_strict",
    "train_moe",
    "train_te",
    "recompute",
    "shared_prefix",
    "measure",
]


def _run(repo_root, tmp_path, **env):
    full = dict(
        os.environ,
        PYTHON=sys.executable,
        GPU_CHECK_OUT=str(tmp_path / "out"),
        PYTHONPATH=str(repo_root),
    )
    full.update(env)
    proc = subprocess.run(
        ["bash", str(repo_root / "scripts/gpu_check.sh")],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout + proc.stderr  # exactly one JSON summary
    return proc.returncode, json.loads(lines[0]), proc.stderr


def test_dry_run_lists_every_part(repo_root, tmp_path):
    rc, summary, err = _run(repo_root, tmp_path, DRY_RUN="1")
    assert rc == 0 and summary["ok"] and list(summary["parts"]) == PARTS
    assert all(p["status"] == "dry" for p in summary["parts"].values())
    assert "tools/bench_loss.py --device cuda" in err and "rollout.engine=hf" in err
    assert "MEGAGRPO_STRICT_DEVICES=1" in err and "bench_recompute.py --device cuda" in err
    assert "tools/measure_cluster.py configs/qwen3_235b_a22b_2node.yaml" in err
    saved = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert saved == summary


def test_a_failing_part_is_recorded_and_the_rest_runs(repo_root, tmp_path):
    rc, summary, _ = _run(
        repo_root,
        tmp_path,
        GPU_CHECK_MODE="cpu",
        GPU_CHECK_ONLY="env,imports,tiny_model",
        GPU_CHECK_FAIL="imports",
    )
    parts = summary["parts"]
    assert rc == 1 and not summary["ok"] and summary["failed"] == ["imports"]
    assert list(parts) == ["env", "imports", "tiny_model"]
    assert parts["env"]["status"] == "ok" and parts["env"]["result"]["cuda_available"] is False
    assert parts["imports"]["status"] == "failed" and parts["imports"]["rc"] == 1
    assert parts["tiny_model"]["status"] == "ok"  # ran after the failure
    assert (tmp_path / "out" / "tiny_model" / "config.json").is_file()


@pytest.mark.slow  # two CPU training processes of the tiny MoE: ~30-60 s on 2 cores
def test_train_moe_part_runs_on_cpu(repo_root, tmp_path):
    """Issue 31: `GPU_CHECK_MODE=cpu GPU_CHECK_ONLY=tiny_model,train_moe` passes: 3 steps of
    the tiny Qwen3-MoE (bf16, LoRA on attention and experts, fused-linear head) with a reward
    that varies, then one step's LoRA gradients in bf16 against the fp32 run (the device is
    the CPU here); the summary says what the device cannot run."""
    rc, summary, err = _run(
        repo_root, tmp_path, GPU_CHECK_MODE="cpu", GPU_CHECK_ONLY="tiny_model,train_moe"
    )
    assert rc == 0 and summary["ok"], err
    res = summary["parts"]["train_moe"]["result"]
    assert [s["step"] for s in res["steps"]] == [1, 2, 3]
    assert any(s["reward/std"] > 0 for s in res["steps"])  # GRPO had something to learn
    grads = res["gradients"]
    assert grads["ok"] and grads["worst_rel_err"] < 0.1 and grads["dtype"] == "bfloat16"
    assert {"experts.B", "attention.B"} <= set(grads["step1"])
    assert grads["trained"]["experts.A"]["cos"] > 0.99
    assert "not_run" in summary
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        assert "not in .whl/" in summary["not_run"]["transformer_engine"]


def test_output_says_what_was_checked(repo_root, tmp_path):
    """Issue 39 item 4: the script states this machine's CPython (version, path, wheel tag)
    first, names before pytest runs which tests/gpu files will run or skip and why, and
    the JSON gives per file what ran and why the rest did not; train_te (item 3b) is
    recorded skipped, with its reason, where Transformer Engine does not import."""
    import importlib.util

    tests = "tests/gpu/test_kernel_cuda.py tests/gpu/test_te_lora_grads.py"
    rc, summary, err = _run(
        repo_root,
        tmp_path,
        GPU_CHECK_MODE="cpu",
        GPU_CHECK_ONLY="gpu_tests,train_te",
        GPU_CHECK_TESTS=tests,
    )
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    first = err.splitlines()[0]
    assert first.startswith(f"gpu_check: CPython {here}") and tag in first, err
    assert sys.executable in first
    assert summary["python"]["wheel_tag"] == tag
    assert summary["python"]["executable"] == sys.executable
    assert "skips  tests/gpu/test_te_lora_grads.py" in err and "needs CUDA" in err
    files = summary["parts"]["gpu_tests"]["result"]["files"]
    assert set(files) == set(tests.split())
    te = files["tests/gpu/test_te_lora_grads.py"]
    assert te["passed"] == 0 and te["skipped"] > 0 and te["expected"] == "skip"
    assert "Transformer Engine" in te["needs"] and "CUDA" in te["needs"]
    assert summary["gpu_tests"]["ran"] == []
    assert set(summary["gpu_tests"]["not_run"]) == set(tests.split())
    assert "tests/gpu not run: tests/gpu/test_kernel_cuda.py" in err
    if importlib.util.find_spec("transformer_engine") is None:
        part = summary["parts"]["train_te"]
        assert part["status"] == "skipped" and "transformer_engine" in part["reason"]
        assert "not in .whl/" in summary["not_run"]["transformer_engine"]
    assert rc == 0 and summary["ok"]


def test_measure_part_writes_the_hw_file_plan_memory_reads(repo_root, tmp_path):
    """Issue 40: the single-GPU part of tools/measure_cluster.py (here on the CPU, tiny sizes)
    writes a file `plan-memory --hw-file` accepts, with the HBM copy and the GEMMs timed."""
    from megagrpo.plan.hwfile import hardware_from_file, read_measurements

    rc, summary, err = _run(repo_root, tmp_path, GPU_CHECK_MODE="cpu", GPU_CHECK_ONLY="measure")
    assert rc == 0 and summary["parts"]["measure"]["status"] == "ok", err
    path = tmp_path / "out" / "cluster_1gpu.json"
    data = read_measurements(path)
    assert data["world"] == 1 and {m["op"] for m in data["measurements"]} == {"hbm_copy", "gemm"}
    assert hardware_from_file(path).hbm_gb_s == data["hardware"]["hbm_gb_s"] > 0


def test_time_budget_skips_late_parts(repo_root, tmp_path):
    rc, summary, _ = _run(repo_root, tmp_path, GPU_CHECK_MODE="cpu", GPU_CHECK_BUDGET_S="5")
    assert rc == 0 and all(p["status"] == "skipped" for p in summary["parts"].values())


def test_wheels_built_for_another_cpython_are_named(repo_root, tmp_path):
    """.whl/ with CPython-specific wheels of another version: the wheels part fails saying
    which CPython they were built for and which one this machine has."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    other = "cp39" if sys.version_info[:2] != (3, 9) else "cp310"
    (wheels / f"numpy-2.0.0-{other}-{other}-linux_x86_64.whl").write_bytes(b"")
    (wheels / "omegaconf-2.3.0-py3-none-any.whl").write_bytes(b"")
    broken = tmp_path / "broken"  # megatron that does not import: the wheels part must act
    (broken / "megatron").mkdir(parents=True)
    (broken / "megatron" / "__init__.py").write_text("raise ImportError('not installed')\n")
    rc, summary, _ = _run(
        repo_root,
        tmp_path,
        GPU_CHECK_MODE="cpu",
        GPU_CHECK_ONLY="wheels",
        MEGAGRPO_WHEELS=str(wheels),
        PYTHONPATH=f"{broken}{os.pathsep}{repo_root}",
    )
    part = summary["parts"]["wheels"]
    assert rc == 1 and part["status"] == "failed"
    log = (tmp_path / "out" / "logs" / "wheels.log").read_text()
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert f"built for CPython {other}" in log and f"is {here}" in log
