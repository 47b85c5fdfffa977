"""Every script in tools/ runs in its ``--quick`` mode, so a benchmark cannot rot unseen
(bench_step.py once failed on an import for weeks). Each run is a fresh subprocess, as a user
runs it; the test checks the exit status and the line that says the tool did its work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SLOW = pytest.mark.slow

# tool -> (a line its --quick output must hold, marks)
QUICK = {
    "bench_convert.py": ("(transformers from_pretrained / save_pretrained)", [SLOW]),
    "bench_curriculum.py": ("target < 10 ms", []),
    "bench_fingerprint.py": ("SHA-256 all", []),
    "bench_loss.py": ("max |logp fused - logp naive|", []),
    "bench_oversample.py": ("dynamic/gen_batches", [SLOW]),
    "bench_packing.py": ("padded waste", []),
    "bench_partial.py": ('"speedup"', [SLOW]),
    "bench_prefix.py": ("crossover (shared faster than rows)", [SLOW]),
    "bench_placement.py": ('"speedup"', [SLOW, pytest.mark.distributed]),
    "bench_recompute.py": ("(equal: True", [SLOW]),
    "bench_rollout.py": ("model tiny-dense", [SLOW]),
    "bench_step.py": ("perf/step_s", [SLOW]),
    "bench_sync.py": ("Qwen3-235B-A22B estimate", [SLOW, pytest.mark.distributed]),
    "bench_sync_verify.py": ("checksums s", [SLOW]),
    "bench_train_memory.py": ("fused linear  peak", [SLOW]),
    "convert_ckpt.py": ("bitwise True", [SLOW]),
    "gpu_check_moe.py": ("CPU bf16 against CPU fp32, ok True", [SLOW]),
    "learning_efficiency.py": ("| original (R=3) | 1 |", [SLOW]),
    "make_demo_mcq.py": ("regenerate byte for byte: True", []),
    "make_demo_problems.py": ("regenerate byte for byte: True", []),
    "measure_cluster.py": ("hardware for plan-memory --hw-file", [SLOW, pytest.mark.distributed]),
    "repro_article.py": ("all levels, knapsack + carry", [SLOW]),
    "upstream_wheels.py": ("vllm-", []),
}

# tools whose smoke run also checks that --json prints nothing but JSON
JSON_QUICK = {"bench_step.py": ["--json"]}


def test_every_tool_has_a_quick_mode_and_a_smoke_run():
    tools = sorted(p.name for p in TOOLS.glob("*.py"))
    assert tools == sorted(QUICK), "a tool without a --quick smoke run here"
    for name in tools:
        assert '"--quick"' in (TOOLS / name).read_text(encoding="utf-8"), name


@pytest.mark.parametrize(
    "tool",
    [  # the slow ones first: with two xdist workers they start at once (tests/conftest.py)
        pytest.param(t, marks=marks)
        for t, (_, marks) in sorted(QUICK.items(), key=lambda kv: (SLOW not in kv[1][1], kv[0]))
    ],
)
def test_tool_quick_runs(tool):
    expected = QUICK[tool][0]
    args = JSON_QUICK.get(tool, [])
    proc = subprocess.run(
        [sys.executable, str(TOOLS / tool), "--quick", *args],
        capture_output=True,
        text=True,
        cwd=TOOLS.parent,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{tool} --quick exited {proc.returncode}:\n{out[-4000:]}"
    assert expected in proc.stdout, f"{tool} --quick printed no {expected!r}:\n{out[-4000:]}"
    if "--json" in args:  # stdout holds the JSON object only (vLLM logs to stdout)
        json.loads(proc.stdout)
