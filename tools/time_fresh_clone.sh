#!/usr/bin/env bash
# Time what a new user does: `git clone` then `make demo`, from nothing: a temporary clone
# with its own .venv, an empty model cache ($MEGAGRPO_CACHE) and no pip cache. Prints the
# phases (clone, install, demo start-up, steps, evaluations) and the total; touches no other
# venv or cache.
#
#   bash tools/time_fresh_clone.sh [REPO] [make-overrides...]
#       REPO: a path or URL to clone (default: this checkout's committed HEAD)
#   KEEP=1 keeps the temporary directory (default: removed at the end).
#
# The figure in the README is this script's `total`, on a quiet 2-core machine (`uptime`
# is printed before and after: a load above ~0.5 at the start means the figure is inflated).
set -euo pipefail -o noclobber  # `>` never truncates an existing file
here=$(cd "$(dirname "$0")/.." && pwd)
repo=${1:-$here}
shift || true
tmp=$(mktemp -d /tmp/megagrpo-fresh.XXXXXX)
cleanup() { [ "${KEEP:-0}" = 1 ] && echo "kept $tmp" || rm -rf "$tmp"; }
trap cleanup EXIT
export MEGAGRPO_CACHE="$tmp/cache" PIP_NO_CACHE_DIR=1 WANDB_MODE=offline
echo "start: $(date -u +%FT%TZ) | $(uptime)"
t0=$(date +%s.%N)
git clone -q "$repo" "$tmp/megagrpo"
t1=$(date +%s.%N)
cd "$tmp/megagrpo"
make setup-demo 2>&1 | tail -3
t2=$(date +%s.%N)
make demo "$@" >"$tmp/demo.log" 2>&1 || { tail -40 "$tmp/demo.log"; exit 1; }
t3=$(date +%s.%N)
grep -E "^(done|learning):" "$tmp/demo.log" || true
echo "end: $(date -u +%FT%TZ) | $(uptime)"
python3 - "$t0" "$t1" "$t2" "$t3" "$tmp/megagrpo/runs/demo_cpu/metrics.jsonl" "$tmp/demo.log" <<'EOF'
import json, re, sys
from datetime import datetime
t0, t1, t2, t3 = map(float, sys.argv[1:5])
rows = [json.loads(line) for line in open(sys.argv[5])]
steps = [r for r in rows if r.get("step", 0) > 0]
log = open(sys.argv[6]).read()
stamps = re.findall(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ INFO (\S+): (.*)$", log, re.M)
def at(pattern):
    for ts, _, msg in stamps:
        if re.search(pattern, msg):
            return datetime.strptime(ts, "%Y-%m-%d %H:%M:%S").timestamp()
    return None
ready = at(r"run dir .* starting at step")
def mean(key):
    vals = [r[key] for r in steps if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")
print(f"clone     {t1 - t0:7.1f} s")
print(f"install   {t2 - t1:7.1f} s  (make setup-demo: fresh .venv)")
if ready:
    print(f"start-up  {ready - t2:7.1f} s  (imports, model conversion, policy, vLLM)")
train = sum(r.get("perf/step_s") or 0.0 for r in steps)
print(f"steps     {train:7.1f} s  ({len(steps)} steps, {mean('perf/step_s'):.1f} s/step: "
      f"gen {mean('perf/gen_s'):.1f}, train {mean('perf/train_s'):.1f}, "
      f"sync {mean('perf/sync_s'):.1f})")
print(f"demo      {t3 - t2:7.1f} s  (make demo after the install; evaluations and the rest)")
print(f"total     {t3 - t0:7.1f} s  = {int((t3 - t0) // 60)} min {int((t3 - t0) % 60)} s")
EOF
