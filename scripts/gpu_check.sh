#!/usr/bin/env bash
# The first GPU check of megagrpo (issue 11): one H200 (or H100), at most ~8 minutes, no
# internet, only torch and Triton preinstalled. Runs, each part with its own time limit and
# log, going on when one fails:
#   env          torch / CUDA / NCCL / GPU facts (fails without CUDA in cuda mode)
#   wheels       pip install --no-index of scripts/gpu_check_requirements.txt from .whl/
#                (scripts/gpu_wheels.sh fills it on a machine with PyPI); skipped when
#                everything imports already; fails naming both versions when .whl/ holds
#                CPython-specific wheels (cpXY tags) built for another CPython than $PYTHON
#   imports      megagrpo, megatron.core, transformers import
#   gpu_tests    pytest tests/gpu: native Triton loss kernels vs torch, strict device checks
#                on NCCL, TE-vs-local LoRA grads (skipped without TE), vLLM (skipped without)
#   bench_loss   tools/bench_loss.py --device cuda: fused loss vs naive (and Liger if there)
#   tiny_model   random tiny Qwen3 and Qwen3-MoE checkpoints for the training runs
#   train        megagrpo train (Megatron local spec on CUDA + NCCL, world 1, HF rollouts),
#                3 steps, every weight sync verified; reward toy_first_token (1 when the
#                first sampled token id is 0 mod 4: it varies within a group even on the
#                random model, so the LoRA update and the sync's change test really run)
#   train_strict the same, 1 step, with MEGAGRPO_STRICT_DEVICES=1 (collectives and loss inputs
#                must be CUDA tensors; needs the trainer to honour the variable)
#   train_moe    the tiny Qwen3-MoE (4 experts), LoRA on attention and every expert, bf16,
#                Megatron on CUDA, fused-linear head: megagrpo train 3 steps (toy reward,
#                HF rollouts), then tools/gpu_check_moe.py: one step's LoRA gradients on the
#                device in bf16 against a CPU fp32 run of the same code (relative error)
#   recompute    tools/bench_recompute.py --device cuda: peak memory, recompute none vs full
# and prints ONE JSON summary on stdout (also written to $OUT/gpu_check.json), with
# "not_run": what the device cannot run here and why (vLLM and Transformer Engine do not
# travel in .whl/). Exit status 0 when every part that ran passed.
#
#   bash scripts/gpu_check.sh                     # on the GPU machine
#   GPU_CHECK_MODE=cpu bash scripts/gpu_check.sh  # the same parts on CPU, small (control flow)
#   DRY_RUN=1 bash scripts/gpu_check.sh           # print the commands, run nothing
# Knobs: GPU_CHECK_OUT (default gpu_check_out), GPU_CHECK_BUDGET_S (default 460, CPU mode
# 460 x GPU_CHECK_SLOWDOWN: parts that would start later are skipped), GPU_CHECK_SLOWDOWN
# (CPU mode: every part's time limit x this, default 6: a shared 2-core machine imports
# megatron in ~60 s), GPU_CHECK_ONLY=part,part, MEGAGRPO_WHEELS (default .whl), PYTHON.
# GPU_CHECK_FAIL=part makes that part fail on purpose (tests this script).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${GPU_CHECK_MODE:-cuda}
DRY=${DRY_RUN:-0}
OUT=${GPU_CHECK_OUT:-gpu_check_out}
SLOW=1
[ "${GPU_CHECK_MODE:-cuda}" = cpu ] && SLOW=${GPU_CHECK_SLOWDOWN:-6}
BUDGET=${GPU_CHECK_BUDGET_S:-$((460 * SLOW))}
WHEELS=${MEGAGRPO_WHEELS:-.whl}
PY=${PYTHON:-python3}
ONLY=${GPU_CHECK_ONLY:-}
FAIL=${GPU_CHECK_FAIL:-}
case "$MODE" in cuda | cpu) ;; *) echo "gpu_check: GPU_CHECK_MODE must be cuda or cpu" >&2; exit 2 ;; esac
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
PARTS="$OUT/parts.jsonl"
: > "$PARTS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
if [ "$MODE" = cpu ]; then
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  DEV=cpu
else
  unset TRITON_INTERPRET
  DEV=cuda
fi
START=$(date +%s)

record() { # record NAME STATUS RC MILLISECONDS LOGFILE
  "$PY" - "$@" >> "$PARTS" <<'PYEOF'
import json, sys
name, status, rc, ms, log = sys.argv[1:6]
secs = int(ms) / 1000
tail = ""
if log and log != "-":
    try:
        tail = open(log, encoding="utf-8", errors="replace").read()[-800:]
    except OSError:
        pass
print(json.dumps({"part": name, "status": status, "rc": int(rc), "seconds": float(secs), "log_tail": tail}))
PYEOF
}

part() { # part NAME LIMIT_S CMD...   (LIMIT_S: on the GPU; CPU mode x GPU_CHECK_SLOWDOWN)
  local name=$1 limit=$(($2 * SLOW))
  shift 2
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then
    record "$name" skipped 0 0 -
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$DRY" = 1 ]; then
    printf 'DRY %-12s (%3ss): %s\n' "$name" "$limit" "$*" >&2
    record "$name" dry 0 0 -
    return 0
  fi
  [ "$name" = "$FAIL" ] && set -- false
  local log="$OUT/logs/$name.log" t0 t1 rc status
  t0=$(date +%s%N)
  if [ "$(type -t "$1")" = function ]; then # a shell function of this script: no timeout(1)
    "$@" > "$log" 2>&1
  else
    timeout --kill-after=15 "$limit" "$@" > "$log" 2>&1
  fi
  rc=$?
  t1=$(date +%s%N)
  status=ok
  [ "$rc" -ne 0 ] && status=failed
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; fi
  record "$name" "$status" "$rc" "$(((t1 - t0) / 1000000))" "$log"
  echo "gpu_check: $name $status (rc $rc)" >&2
  return 0
}

# ---------------------------------------------------------------- the parts
ENV_PY='import json, platform, torch
d = {"python": platform.python_version(), "torch": torch.__version__,
     "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
try:
    import triton; d["triton"] = triton.__version__
except Exception as e: d["triton"] = repr(e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(0)),
             memory_gib=round(p.total_memory / 2**30, 1), nccl=list(torch.cuda.nccl.version()),
             device_count=torch.cuda.device_count())
print(json.dumps(d))
import sys; sys.exit(0 if d["cuda_available"] or sys.argv[1] == "cpu" else 3)'

IMPORTS_PY='import importlib, sys
missing = []
for m in ("megatron.core", "transformers", "omegaconf", "safetensors", "sentencepiece", "numpy", "pytest", "megagrpo.model.policy"):
    try: importlib.import_module(m)
    except Exception as e: missing.append(f"{m}: {e!r}")
print("\n".join(missing) or "all imports ok"); sys.exit(1 if missing else 0)'

wheels() {
  if "$PY" -c "$IMPORTS_PY" > /dev/null 2>&1; then
    echo "everything imports: nothing to install"
    return 0
  fi
  if [ ! -d "$WHEELS" ]; then
    echo "no wheel directory $WHEELS (run scripts/gpu_wheels.sh on a machine with PyPI)"
    return 1
  fi
  local want other
  want=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  # CPython-specific wheels name their interpreter: name-ver-cpXY-abi-platform.whl
  other=$(ls "$WHEELS" | sed -n 's/^[^-]*-[^-]*-\(cp[0-9]*\)-.*\.whl$/\1/p' | sort -u | grep -v "^$want\$" || true)
  if [ -n "$other" ]; then
    echo "$WHEELS holds wheels built for CPython $(echo $other | tr '\n' ' ')but this machine's" \
      "$PY is $want ($("$PY" -c 'import platform; print(platform.python_version())')):" \
      "rebuild them here with PYTHON=$PY scripts/gpu_wheels.sh (or on a machine with the same CPython)"
    return 1
  fi
  timeout 80 "$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps \
    -r scripts/gpu_check_requirements.txt
}

TINY="$OUT/tiny_model"
TINY_MOE="$OUT/tiny_moe"
train_moe() { # train 3 steps on the tiny MoE, then one step's LoRA gradients vs CPU fp32
  local t=$((100 * SLOW))
  # a bf16 trainer merges into the fp32 checkpoint's HF engine: lossy (issue 40), consented
  timeout "$t" "$PY" -m megagrpo.cli train "${TRAIN_ARGS[@]}" "model.hf_path=$TINY_MOE" \
    model.dtype=bfloat16 loss.fused_linear=true trainer.name=gpu_check_moe trainer.max_steps=3 \
    trainer.allow_lossy_sync=true || return 1
  timeout "$t" "$PY" tools/gpu_check_moe.py grads --model "$TINY_MOE" --device "$DEV" \
    --dtype bfloat16 --out "$OUT/moe_grads_$DEV.pt" || return 1
  CUDA_VISIBLE_DEVICES= timeout "$t" "$PY" tools/gpu_check_moe.py grads --model "$TINY_MOE" \
    --device cpu --dtype float32 --out "$OUT/moe_grads_ref.pt" || return 1
  "$PY" tools/gpu_check_moe.py compare "$OUT/moe_grads_$DEV.pt" "$OUT/moe_grads_ref.pt" --json
}

TRAIN_ARGS=(configs/demo_cpu.yaml rollout.engine=hf "model.hf_path=$TINY" "trainer.output_dir=$OUT/runs"
  trainer.eval_every=0 trainer.save_every=0 trainer.export_adapter=false metrics.wandb_mode=disabled
  dynamic.enabled=false "rewards.functions=[{name: toy_first_token}]")
if [ "$MODE" = cpu ]; then
  LOSS_ARGS=(--tokens 256 --vocab 2048 --seq-len 128 --methods naive,fused)
  RECOMPUTE_ARGS=(--layers 2 --hidden 128 --ffn 256 --seq 128)
  STEPS=1
else
  LOSS_ARGS=()
  RECOMPUTE_ARGS=(--layers 16 --hidden 1024 --ffn 2816 --seq 2048 --batch 2)
  STEPS=3
fi
GPU_TESTS=(tests/gpu)
[ "$MODE" = cpu ] && GPU_TESTS+=(tests/unit/test_parallel_strict.py)

part env 30 "$PY" -c "$ENV_PY" "$MODE"
part wheels 90 wheels
part imports 60 "$PY" -c "$IMPORTS_PY"
part gpu_tests 150 "$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}" --junitxml="$OUT/gpu_tests.xml"
part bench_loss 75 "$PY" tools/bench_loss.py --device "$DEV" --json "${LOSS_ARGS[@]}"
part tiny_model 45 "$PY" -c "from megagrpo.testing import build_tiny_model; build_tiny_model('$TINY', 'dense'); build_tiny_model('$TINY_MOE', 'moe')"
part train 100 "$PY" -m megagrpo.cli train "${TRAIN_ARGS[@]}" trainer.name=gpu_check "trainer.max_steps=$STEPS"
part train_strict 70 env MEGAGRPO_STRICT_DEVICES=1 "$PY" -m megagrpo.cli train "${TRAIN_ARGS[@]}" trainer.name=gpu_check_strict trainer.max_steps=1
part train_moe 150 train_moe
part recompute 75 "$PY" tools/bench_recompute.py --device "$DEV" --json "${RECOMPUTE_ARGS[@]}"

# ---------------------------------------------------------------- measure (issue 40)
# The planner's single-GPU terms measured on this GPU (tools/measure_cluster.py, world 1): HBM
# copy, pinned host <-> device copies, training GEMMs at the 235B shapes; writes the JSON that
# `megagrpo plan-memory --hw-file` reads ($OUT/cluster_1gpu.json). CPU mode: tiny sizes.
MEASURE_ARGS=(configs/qwen3_235b_a22b_2node.yaml --out "$OUT/cluster_1gpu.json")
[ "$MODE" = cpu ] && MEASURE_ARGS+=(--scale 0.0001 --repeats 2)
part measure 60 "$PY" tools/measure_cluster.py "${MEASURE_ARGS[@]}"

# ---------------------------------------------------------------- the summary
"$PY" - "$PARTS" "$OUT" "$MODE" "$(($(date +%s) - START))" <<'PYEOF'
import json, sys
from pathlib import Path
parts_file, out, mode, elapsed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
parts = {}
for line in Path(parts_file).read_text().splitlines():
    p = json.loads(line)
    parts[p.pop("part")] = p

def last_json(name):  # the JSON object a part printed last (one line or indented)
    log = out / "logs" / f"{name}.log"
    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]))
            except ValueError:
                try:
                    return json.loads(lines[i])
                except ValueError:
                    continue
    return None

for name in ("env", "bench_loss", "recompute", "train_moe"):
    if name in parts and (res := last_json(name)) is not None:
        parts[name]["result"] = res
xml = out / "gpu_tests.xml"
if "gpu_tests" in parts and xml.exists():
    import xml.etree.ElementTree as ET
    suites = ET.parse(xml).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    parts["gpu_tests"]["result"] = {k: sum(int(s.get(k, 0)) for s in suites)
                                    for k in ("tests", "failures", "errors", "skipped")}
for name, run in (("train", "gpu_check"), ("train_strict", "gpu_check_strict"),
                  ("train_moe", "gpu_check_moe")):
    runs = sorted((out / "runs").glob(f"{run}/metrics.jsonl"))
    if name in parts and runs:
        rows = [json.loads(l) for l in runs[0].read_text().splitlines() if l.strip()]
        keep = ("step", "loss/policy", "reward/mean", "reward/std", "train/grad_norm",
                "sync/probe_max_diff", "perf/step_s")
        steps = [{k: r[k] for k in keep if k in r} for r in rows]
        if name == "train_moe":
            parts[name].setdefault("result", {})
            parts[name]["result"] = {"steps": steps, "gradients": parts[name]["result"]}
        else:
            parts[name]["result"] = steps
import importlib.util
not_run = {}
if importlib.util.find_spec("vllm") is None:
    not_run["vllm"] = ("vLLM 0.33.0 (~336 MB CUDA 13 wheel with its torch pin) does not travel "
                       "in .whl/: colocated rollouts, adapter sync into vLLM, MoE LoRA under "
                       "EP, the idle lock-stepped rank and FP8 + expert LoRA are not run here "
                       "(tests/gpu skips them; tests/contract runs vLLM 0.33's Python on CPU)")
if importlib.util.find_spec("transformer_engine") is None:
    not_run["transformer_engine"] = ("Transformer Engine 2.11's torch extension is a source "
                                     "build against the device's torch, not in .whl/: the TE "
                                     "spec (grouped-GEMM experts, TE LoRA grads) is not run; "
                                     "the local spec is")
bad = [n for n, p in parts.items() if p["status"] in ("failed", "timeout")]
summary = {"gpu_check": "megagrpo issue 11", "mode": mode, "ok": not bad, "failed": bad,
           "elapsed_s": elapsed, "not_run": not_run, "parts": parts}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
sys.exit(1 if bad else 0)
PYEOF
