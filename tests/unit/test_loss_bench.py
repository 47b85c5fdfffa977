"""tools/bench_loss.py runs end to end at a tiny shape and reports the documented keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_loss.py"


def test_bench_loss_json_smoke():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--tokens",
            "64",
            "--vocab",
            "2048",
            "--seq-len",
            "16",
            "--methods",
            "naive,fused",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    for key in ("peak_bytes_naive", "peak_bytes_fused", "max_abs_err_logp", "max_abs_err_grad"):
        assert key in out, key
    assert out["max_abs_err_logp"] < 1e-4
    assert out["max_abs_err_grad"] < 1e-5  # bf16 grads of the same fp32 math
    assert out["max_abs_err_loss_fused"] < 1e-5
    assert out["peak_bytes_naive"] > 0  # (the ordering only shows at real sizes, see the note)
    assert "allocator" in out["memory_method"]
