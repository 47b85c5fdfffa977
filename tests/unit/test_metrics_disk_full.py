"""metrics.jsonl under a file size limit (`ulimit -f`): the failed append names the file and
the free space, and leaves no torn row."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from megagrpo.errors import StorageError
    from megagrpo.metrics.logger import JsonlLogger
    path = sys.argv[1]
    lg = JsonlLogger(path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (600, resource.RLIM_INFINITY))
    try:
        for step in range(1, 100):
            lg.log(step, {"reward/mean": 0.125 * step, "loss/policy": -0.5})
    except StorageError as exc:
        print("ERROR", exc)
    """
)


def test_a_full_metrics_file_is_named_and_holds_no_torn_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ERROR metrics row of step "), out.stdout + out.stderr[-2000:]
    assert str(path) in out.stdout and "errno 27, EFBIG" in out.stdout and "MB free" in out.stdout
    text = path.read_text()
    assert text.endswith("\n") and len(text) <= 600
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and rows
