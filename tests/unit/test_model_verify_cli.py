"""`megagrpo verify-model --hf DIR --json` end to end (one rank, in-process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_verify_model_cli_json(tiny_moe_dir):
    cmd = [
        sys.executable,
        "-m",
        "megagrpo.cli",
        "verify-model",
        "--hf",
        str(tiny_moe_dir),
        "--json",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout[out.stdout.index("{") :])
    assert rep["world_size"] == 1 and rep["ok"] is True
    assert rep["max_abs_logit_diff"] < 1e-4
    assert rep["lora_zero_init_max_diff"] == 0.0 and rep["roundtrip_bitwise"] is True


def test_verify_model_cli_bad_layout(tiny_moe_dir):
    cmd = [
        sys.executable,
        "-m",
        "megagrpo.cli",
        "verify-model",
        "--hf",
        str(tiny_moe_dir),
        "--ep",
        "3",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "num_experts=4 is not divisible by ep=3" in out.stderr
