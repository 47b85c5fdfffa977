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
#                on NCCL, TE-vs-local LoRA grads (skipped without TE), vLLM (skipped without).
#                Before it runs, the script names every tests/gpu file it will run and every
#                one that will skip and why (needs TE / vLLM / 2 GPUs, not importable here);
#                the JSON gives per file what ran, passed, failed and was skipped (and why)
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
#   train_te     only where Transformer Engine imports (a cluster node; else recorded skipped,
#                with the reason): the tiny Qwen3-MoE on the TE spec (fused layernorm
#                linears, TEGroupedMLP experts), LoRA on attention and every expert, bf16,
#                megagrpo train 3 steps, then tools/gpu_check_moe.py --spec te: one step's
#                LoRA gradients and log-probs against the local spec in fp32 on the device
#   recompute    tools/bench_recompute.py --device cuda: peak memory, recompute none vs full
#   shared_prefix tools/bench_prefix.py: train pass, shared prefix vs rows (issue 43)
#   measure      tools/measure_cluster.py world 1: HBM copy, host<->device, GEMMs at the 235B
#                shapes -> $OUT/cluster_1gpu.json for `megagrpo plan-memory --hw-file`
# The script first states the machine's CPython (version, path, wheel tag: what .whl/ must be
# built for) and prints ONE JSON summary on stdout (also written to $OUT/gpu_check.json), with
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
# GPU_CHECK_TESTS="path ..." replaces the pytest paths of gpu_tests (default tests/gpu).
# GPU_CHECK_FAIL=part makes that part fail on purpose (tests this script).
set -uo pipefail -o noclobber # `>` never truncates an existing file: old ones are removed first
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
rm -f -- "$PARTS" && : >"$PARTS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
if [ "$MODE" = cpu ]; then
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  DEV=cpu
else
  unset TRITON_INTERPRET
  DEV=cuda
fi
START=$(date +%s)

record() { # record NAME STATUS RC MILLISECONDS LOGFILE [REASON]  (one line appended to $PARTS)
  "$PY" - "$PARTS" "$@" <<'PYEOF'
import json, sys
from megagrpo import fileio
parts, name, status, rc, ms, log = sys.argv[1:7]
reason = sys.argv[7] if len(sys.argv) > 7 else ""
secs = int(ms) / 1000
tail = ""
if log and log != "-":
    try:
        tail = open(log, encoding="utf-8", errors="replace").read()[-800:]
    except OSError:
        pass
row = {"part": name, "status": status, "rc": int(rc), "seconds": float(secs), "log_tail": tail}
if reason:
    row["reason"] = reason
with fileio.open_append_text(parts) as fh:
    fh.write(json.dumps(row) + "\n")
PYEOF
}

skip_part() { # skip_part NAME REASON   (a part this machine cannot run: recorded, not failed)
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$1,"* ]]; then return 0; fi
  record "$1" skipped 0 0 - "$2"
  echo "gpu_check: $1 skipped: $2" >&2
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
  rm -f -- "$log" # a log of an earlier check (noclobber: never written through)
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

# ---------------------------------------------------------------- the machine's CPython
# Stated before anything is installed: .whl/ must hold wheels built for this CPython
# (scripts/gpu_wheels.sh X.Y on a machine with PyPI).
CPYTHON=$("$PY" -c 'import platform, sys; print(f"{platform.python_version()} {sys.executable} cp{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null || echo "? ? ?")
read -r PY_VERSION PY_PATH PY_TAG <<< "$CPYTHON"
echo "gpu_check: CPython $PY_VERSION at $PY_PATH ($PY) -> .whl/ needs $PY_TAG wheels" \
  "(scripts/gpu_wheels.sh ${PY_VERSION%.*})" >&2
TE_OK=0
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("transformer_engine") is None)' \
  2> /dev/null && TE_OK=1
# a cluster node with TE runs the TE tests and train_te as well: ~330 s more on the GPU
[ -z "${GPU_CHECK_BUDGET_S:-}" ] && [ "$TE_OK" = 1 ] && BUDGET=$((BUDGET + 330 * SLOW))

# ---------------------------------------------------------------- the parts
ENV_PY='import json, platform, sys, torch
d = {"python": platform.python_version(), "python_executable": sys.executable, "torch": torch.__version__,
     "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
try:
    import triton; d["triton"] = triton.__version__
except Exception as e: d["triton"] = repr(e)
try:
    import transformer_engine as te; d["transformer_engine"] = te.__version__
except Exception as e: d["transformer_engine"] = f"not importable: {type(e).__name__}"
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
  echo "CPython $PY_VERSION at $PY_PATH: wheels in $WHEELS must be $PY_TAG (or pure Python)"
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

train_te() { # the TE spec: 3 steps, then LoRA gradients and log-probs against the local spec
  local t=$((100 * SLOW))
  timeout "$t" "$PY" -m megagrpo.cli train "${TRAIN_ARGS[@]}" "model.hf_path=$TINY_MOE" \
    model.spec=te model.dtype=bfloat16 loss.fused_linear=true trainer.name=gpu_check_te \
    trainer.max_steps=3 || return 1
  timeout "$t" "$PY" tools/gpu_check_moe.py grads --spec te --model "$TINY_MOE" --device "$DEV" \
    --dtype bfloat16 --out "$OUT/te_grads_$DEV.pt" || return 1
  timeout "$t" "$PY" tools/gpu_check_moe.py grads --spec local --model "$TINY_MOE" \
    --device "$DEV" --dtype float32 --out "$OUT/te_grads_ref.pt" || return 1
  "$PY" tools/gpu_check_moe.py compare "$OUT/te_grads_$DEV.pt" "$OUT/te_grads_ref.pt" --json
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
[ -n "${GPU_CHECK_TESTS:-}" ] && read -r -a GPU_TESTS <<< "$GPU_CHECK_TESTS"
GPU_TESTS_LIMIT=150
[ "$TE_OK" = 1 ] && GPU_TESTS_LIMIT=300 # the TE tests build the tiny models a dozen times

# What tests/gpu will run here and what will skip, and why: stated before pytest runs (the
# summary adds what did run, from pytest's own report).
plan_gpu_tests() {
  "$PY" - "$OUT/gpu_tests_plan.json" "$MODE" "${GPU_TESTS[@]}" <<'PYEOF'
import importlib.util, json, sys
from pathlib import Path
out, mode, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
found = lambda m: importlib.util.find_spec(m) is not None
gpus = 0
if mode == "cuda":
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
why = {
    "CUDA": "no CUDA device (GPU_CHECK_MODE=cpu or no GPU)",
    "Transformer Engine": "transformer_engine is not importable: TE 2.11's torch extension "
    "is a source build against the device's torch and does not travel in .whl/",
    "vLLM": "vllm is not importable: vLLM 0.33.0's CUDA wheel pins its own torch and does "
    "not travel in .whl/",
    "2 GPUs": f"{gpus} GPU(s) here",
}
have = {"CUDA": gpus > 0, "Transformer Engine": found("transformer_engine"),
        "vLLM": found("vllm"), "2 GPUs": gpus >= 2}
files = []
for p in paths:
    path = Path(p)
    files += sorted(path.glob("test_*.py")) if path.is_dir() else [path]
plan = {}
for f in files:
    text = f.read_text(encoding="utf-8", errors="replace")
    needs = ["CUDA"] if "pytest.mark.gpu" in text else []
    needs += [k for k, m in (("Transformer Engine", "transformer_engine"), ("vLLM", "vllm"))
              if m in text]
    needs += ["2 GPUs"] if "device_count()" in text else []
    missing = [n for n in needs if not have[n]]
    plan[str(f)] = {"needs": needs, "expected": "skip" if missing else "run",
                    "why": "; ".join(f"needs {n}: {why[n]}" for n in missing)}
from megagrpo import fileio
fileio.write_text(out, json.dumps(plan, indent=1))
state = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items())
print(f"gpu_check: gpu_tests on this machine ({state}):", file=sys.stderr)
for f, p in plan.items():
    print(f"  {'runs ' if p['expected'] == 'run' else 'skips'}  {f}"
          + (f"  ({p['why']})" if p["why"] else ""), file=sys.stderr)
PYEOF
}

part env 30 "$PY" -c "$ENV_PY" "$MODE"
part wheels 90 wheels
part imports 60 "$PY" -c "$IMPORTS_PY"
if [ "$DRY" != 1 ] && { [ -z "$ONLY" ] || [[ ",$ONLY," == *",gpu_tests,"* ]]; }; then plan_gpu_tests; fi
part gpu_tests "$GPU_TESTS_LIMIT" "$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}" --junitxml="$OUT/gpu_tests.xml"
part bench_loss 75 "$PY" tools/bench_loss.py --device "$DEV" --json "${LOSS_ARGS[@]}"
part tiny_model 45 "$PY" -c "from megagrpo.testing import build_tiny_model; build_tiny_model('$TINY', 'dense'); build_tiny_model('$TINY_MOE', 'moe')"
part train 100 "$PY" -m megagrpo.cli train "${TRAIN_ARGS[@]}" trainer.name=gpu_check "trainer.max_steps=$STEPS"
part train_strict 70 env MEGAGRPO_STRICT_DEVICES=1 "$PY" -m megagrpo.cli train "${TRAIN_ARGS[@]}" trainer.name=gpu_check_strict trainer.max_steps=1
part train_moe 150 train_moe
if [ "$TE_OK" = 1 ] || [ "$DRY" = 1 ]; then
  part train_te 180 train_te
else
  skip_part train_te "transformer_engine is not importable here (TE 2.11's torch extension is a source build, not in .whl/): the TE spec is checked on a cluster node"
fi
part recompute 75 "$PY" tools/bench_recompute.py --device "$DEV" --json "${RECOMPUTE_ARGS[@]}"

# ---------------------------------------------------------------- shared prefix (issue 43)
# tools/bench_prefix.py on the device: train-pass time, saved activations and the CUDA peak,
# shared prefix vs rows, G 8 at prompt:completion 0.1 / 1 / 10 (bf16, a 1024-wide model); the
# log-prob / gradient parity is tests/gpu/test_shared_prefix_gpu.py in the gpu_tests part.
shared_prefix() {
  local args=(--json --plot "$OUT/bench_prefix.png")
  if [ "$MODE" = cpu ]; then
    args+=(--quick)
  else
    args+=(--device cuda --dtype bfloat16 --group-sizes 8 --ratios 0.1,1,10 --tokens 1024
      --hidden 1024 --layers 8)
  fi
  timeout --kill-after=15 $((90 * SLOW)) "$PY" tools/bench_prefix.py "${args[@]}"
}
part shared_prefix 90 shared_prefix

# ---------------------------------------------------------------- measure (issue 40)
# The planner's single-GPU terms measured on this GPU (tools/measure_cluster.py, world 1): HBM
# copy, pinned host <-> device copies, training GEMMs at the 235B shapes; writes the JSON that
# `megagrpo plan-memory --hw-file` reads ($OUT/cluster_1gpu.json). CPU mode: tiny sizes.
MEASURE_ARGS=(configs/qwen3_235b_a22b_2node.yaml --out "$OUT/cluster_1gpu.json")
[ "$MODE" = cpu ] && MEASURE_ARGS+=(--scale 0.0001 --repeats 2)
part measure 60 "$PY" tools/measure_cluster.py "${MEASURE_ARGS[@]}"

# ---------------------------------------------------------------- the summary
"$PY" - "$PARTS" "$OUT" "$MODE" "$(($(date +%s) - START))" "$CPYTHON" <<'PYEOF'
import json, sys
from pathlib import Path
parts_file, out, mode, elapsed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
py_version, py_path, py_tag = (sys.argv[5].split(" ", 2) + ["?", "?", "?"])[:3]
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

for name in ("env", "bench_loss", "recompute", "train_moe", "train_te"):
    if name in parts and (res := last_json(name)) is not None:
        parts[name]["result"] = res
xml = out / "gpu_tests.xml"
plan_file = out / "gpu_tests_plan.json"
plan = json.loads(plan_file.read_text()) if plan_file.exists() else {}
tests_run = {"ran": [], "not_run": {}, "failed": []}
if "gpu_tests" in parts and xml.exists():
    import xml.etree.ElementTree as ET
    suites = ET.parse(xml).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    parts["gpu_tests"]["result"] = {k: sum(int(s.get(k, 0)) for s in suites)
                                    for k in ("tests", "failures", "errors", "skipped")}
    files = {f: {"passed": 0, "failed": 0, "skipped": 0, "skip_reasons": []} for f in plan}
    for case in (c for s in suites for c in s.iter("testcase")):
        mod = case.get("classname", "").split(".")  # tests.gpu.test_x[.Class]
        while mod and not mod[-1].startswith("test_"):
            mod.pop()
        f = files.setdefault("/".join(mod) + ".py", {"passed": 0, "failed": 0, "skipped": 0,
                                                      "skip_reasons": []})
        skip = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            f["failed"] += 1
        elif skip is not None:
            f["skipped"] += 1
            reason = skip.get("message", "")
            if reason not in f["skip_reasons"]:
                f["skip_reasons"].append(reason)
        else:
            f["passed"] += 1
    for name, f in files.items():
        f.update({k: plan[name][k] for k in ("needs", "expected") if name in plan})
        if f["failed"]:
            tests_run["failed"].append(name)
        if f["passed"] or f["failed"]:
            tests_run["ran"].append(name)
        else:
            why = plan.get(name, {}).get("why") or "; ".join(f["skip_reasons"]) or "no test collected"
            tests_run["not_run"][name] = why
    parts["gpu_tests"]["result"]["files"] = files
    print("gpu_check: tests/gpu ran: " + (", ".join(tests_run["ran"]) or "nothing"), file=sys.stderr)
    for name, why in tests_run["not_run"].items():
        print(f"gpu_check: tests/gpu not run: {name}: {why}", file=sys.stderr)
for name, run in (("train", "gpu_check"), ("train_strict", "gpu_check_strict"),
                  ("train_moe", "gpu_check_moe"), ("train_te", "gpu_check_te")):
    runs = sorted((out / "runs").glob(f"{run}/metrics.jsonl"))
    if name in parts and runs:
        rows = [json.loads(l) for l in runs[0].read_text().splitlines() if l.strip()]
        keep = ("step", "loss/policy", "reward/mean", "reward/std", "train/grad_norm",
                "sync/probe_max_diff", "perf/step_s")
        steps = [{k: r[k] for k in keep if k in r} for r in rows]
        if name in ("train_moe", "train_te"):
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
                                     "spec (grouped-GEMM experts, TE LoRA grads: train_te and "
                                     "the TE tests of tests/gpu) is not run; the local spec is")
bad = [n for n, p in parts.items() if p["status"] in ("failed", "timeout")]
summary = {"gpu_check": "megagrpo issue 11", "mode": mode, "ok": not bad, "failed": bad,
           "elapsed_s": elapsed,
           "python": {"version": py_version, "executable": py_path, "wheel_tag": py_tag},
           "not_run": not_run, "gpu_tests": tests_run, "parts": parts}
from megagrpo import fileio
fileio.write_text(out / "gpu_check.json", json.dumps(summary, indent=1))
print(json.dumps(summary))
sys.exit(1 if bad else 0)
PYEOF
