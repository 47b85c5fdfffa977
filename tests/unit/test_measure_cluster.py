"""Issue 40 item 4: the planner calibrated on the cluster. The figures of
``tools/measure_cluster.py`` (its 2-rank gloo run is ``tests/integration/test_tools_quick.py``'s;
the single-GPU part ``scripts/gpu_check.sh``'s) fitted by hand, read by ``plan-memory
--hw-file`` (points, not ranges), shown by ``megagrpo report --hw-file``; bad files named;
the two-node Slurm command."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megagrpo.errors import ConfigError
from megagrpo.plan.hwfile import (
    comparison,
    derive_hardware,
    fit_ring,
    hardware_from_file,
    read_measurements,
)
from megagrpo.plan.links import latency_s, ring_bw
from megagrpo.plan.ranges import bounds
from megagrpo.plan.scenario import Assumptions, Hardware

# a 16-rank all-gather over two nodes: 100 us at 8 MB out, 3.1 ms at 1 GB out
# bytes moved per rank = out x 15 / 16: 7.5 MB and 937.5 MB
RING = [
    dict(op="all_gather", ranks=16, nodes=2, bytes=8_000_000, seconds=100e-6),
    dict(op="all_gather", ranks=16, nodes=2, bytes=1_000_000_000, seconds=3.1e-3 + 100e-6),
]


def test_a_ring_is_fitted_by_hand():
    """t = L + b / B through the two sizes: B = (937.5 - 7.5) MB / 3.1 ms = 300 GB/s, L =
    100 us - 7.5 MB / B = 75 us; the planner's 16-rank anchor is that latency (15 hops)."""
    lat, bw = fit_ring([(7.5e6, 100e-6), (937.5e6, 3.2e-3)])
    assert bw == pytest.approx(930e6 / 3.1e-3) and lat == pytest.approx(100e-6 - 7.5e6 / bw)
    hw = derive_hardware(RING, 8)
    assert hw["ring_busbw_gb_s"] == pytest.approx(300.0)
    assert hw["ib_latency_us"] == pytest.approx(75.0)
    # a 32-rank ring would anchor at 75 x 15 / 31 us a hop-scaled 16-rank collective
    wide = [dict(m, ranks=32, nodes=4) for m in RING]
    moved = [float(m["bytes"]) * 31 / 32 for m in wide]
    lat32, _ = fit_ring([(moved[0], 100e-6), (moved[1], 3.2e-3)])
    assert derive_hardware(wide, 8)["ib_latency_us"] == pytest.approx(lat32 * 1e6 * 15 / 31)


def test_copies_and_alltoall_by_hand():
    rows = [
        dict(op="hbm_copy", bytes=1 << 30, seconds=(1 << 30) * 2 / 3.0e12),  # read + write
        dict(op="h2d", bytes=1e9, seconds=1e9 / 24e9),
        dict(op="d2h", bytes=1e9, seconds=1e9 / 22e9),
        # 16 ranks over 2 nodes: 8 of 15 peers remote; 1 GB sent, 15/16 of it to the others
        dict(op="all_to_all", ranks=16, nodes=2, bytes=1e9, seconds=0.03),
    ]
    hw = derive_hardware(rows, 8)
    assert hw["hbm_gb_s"] == pytest.approx(3000.0)
    assert hw["host_gb_s"] == pytest.approx(22.0)  # the slower direction
    assert hw["ib_alltoall_gb_s"] == pytest.approx(1e9 * 15 / 16 * 8 / 15 / 0.03 / 1e9)


def _write(tmp_path, hardware, **extra):
    path = tmp_path / "cluster.json"
    data = {"version": 1, "tool": "tools/measure_cluster.py", "backend": "nccl", "world": 16}
    data.update({"hardware": hardware, "measurements": RING, **extra})
    path.write_text(json.dumps(data))
    return path


def test_measured_figures_replace_the_model_and_leave_the_band(tmp_path):
    """A measured ring bandwidth and latency are used as measured (no comm_eff on top) and are
    points: moving comm_eff or ib_latency_us across their ranges no longer moves them."""
    path = _write(tmp_path, {"ring_busbw_gb_s": 150.0, "ib_latency_us": 90.0})
    hw = hardware_from_file(path)
    a = Assumptions()
    assert ring_bw(16, 8, hw, a) == 150e9 and latency_s(16, 8, hw) == pytest.approx(90e-6)
    assert ring_bw(16, 8, Hardware(), a) == pytest.approx(280e9)

    def step(aa, hh):  # a 16-rank collective of 100 MB
        return latency_s(16, 8, hh) + 1e8 / ring_bw(16, 8, hh, aa)

    b = bounds(step, a, hw)
    assert b["low"] == b["central"] == b["high"]
    assert bounds(step, a, Hardware())["high"] > bounds(step, a, Hardware())["central"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", "not JSON"),
        (json.dumps({"version": 7, "hardware": {}}), "version 1"),
        (json.dumps({"version": 1, "hardware": {"warp_gb_s": 1.0}}), "'warp_gb_s' is not one of"),
        (json.dumps({"version": 1, "hardware": {"hbm_gb_s": -3}}), "hardware.hbm_gb_s"),
    ],
)
def test_a_bad_file_is_named(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as err:
        read_measurements(path)
    assert str(path) in str(err.value)
    with pytest.raises(ConfigError, match="--hw-file"):
        read_measurements(tmp_path / "missing.json")


def test_plan_memory_and_report_show_the_measured_figures(repo_root, tmp_path, capsys):
    from megagrpo.cli import main

    hw = {"ring_busbw_gb_s": 150.0, "ib_latency_us": 90.0, "hbm_gb_s": 3000.0}
    gemm = dict(op="gemm", name="expert_fc1", flops=2e12, seconds=0.004)
    path = _write(tmp_path, hw, device="NVIDIA H100 80GB HBM3", measurements=[*RING, gemm])
    cfg = str(repo_root / "configs/qwen3_235b_a22b_2node.yaml")
    hf = str(repo_root / "configs/qwen3_235b_a22b.hf_config.json")
    assert main(["plan-memory", cfg, "--hf-config", hf, "--hw-file", str(path), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert main(["plan-memory", cfg, "--hf-config", hf, "--json"]) == 0
    modelled = json.loads(capsys.readouterr().out)
    assert measured["hardware"]["ring_busbw_gb_s"] == 150.0
    assert measured["time"]["step_s"] != modelled["time"]["step_s"]
    assert main(["plan-memory", cfg, "--hf-config", hf, "--hw-file", str(path)]) == 0
    assert "hardware measured by tools/measure_cluster.py on NVIDIA H100" in capsys.readouterr().out
    lines = "\n".join(comparison(read_measurements(path)))
    assert "ring_busbw_gb_s" in lines and "280.0" in lines and "150.0" in lines
    assert "500.0" in lines  # the GEMM: 2 TFLOP in 4 ms, beside train_mfu x peak (197.8)


def test_the_two_node_slurm_command(repo_root):
    env = dict(os.environ, DRY_RUN="1", CONFIG="configs/qwen3_235b_a22b_2node.yaml")
    out = subprocess.run(
        ["bash", str(repo_root / "slurm/measure_cluster.sh")],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo_root,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert f"--node-rank={rank} " in line and "--nnodes=2" in line
        assert "--nproc-per-node=8" in line and "tools/measure_cluster.py" in line
        assert "configs/qwen3_235b_a22b_2node.yaml" in line and "--out cluster.json" in line


def test_an_earlier_measurement_is_never_replaced_silently(repo_root, tmp_path, capsys):
    """``--out`` naming an existing file is refused before anything is measured (exit 2, the
    file named, its bytes kept); ``--overwrite`` replaces it. The Slurm script refuses too,
    before it starts the nodes, and passes ``--overwrite`` on with ``OVERWRITE=1``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "measure_cluster", repo_root / "tools/measure_cluster.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    old = tmp_path / "cluster.json"
    old.write_text('{"measured": "yesterday"}\n')
    with pytest.raises(SystemExit) as err:
        tool.parse_args(["--out", str(old)])
    assert err.value.code == 2
    assert f"--out {old} exists" in capsys.readouterr().err
    assert old.read_text() == '{"measured": "yesterday"}\n'
    assert tool.parse_args(["--out", str(old), "--overwrite"]).out == str(old)
    assert tool.parse_args(["--out", str(tmp_path / "new.json")]).out.endswith("new.json")

    def slurm(**extra):
        env = dict(os.environ, DRY_RUN="1", OUT=str(old), **extra)
        return subprocess.run(
            ["bash", str(repo_root / "slurm/measure_cluster.sh")],
            capture_output=True, text=True, env=env, cwd=repo_root, timeout=60,
        )  # fmt: skip

    refused = slurm()
    assert refused.returncode == 2 and str(old) in refused.stderr and not refused.stdout
    again = slurm(OVERWRITE="1")
    assert again.returncode == 0, again.stderr
    assert all(line.endswith("--overwrite") for line in again.stdout.splitlines())
