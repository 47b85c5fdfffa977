"""Shared prefix under Megatron layouts on 2 gloo ranks, one launch (issue 43 item 2): the
tiny Qwen3-MoE at TP2 x EP2 with sequence parallelism (the experts folded over the TP ranks;
R3 replay by the THD route, then megatron's attention under the segments' mask), and at PP2
(Megatron's 1F1B schedule with segment rows).
Each against the rows on the same batch in the same processes: per-token log-probs, loss and
every LoRA gradient (gathered over the ranks) within 1e-5 relative (fp32; see
tests/unit/test_shared_prefix_model.py for the measured spread)."""

from __future__ import annotations

import pytest
from prefix_parity import rel_diffs, run_parity

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

FP32 = 1e-5


@pytest.fixture(scope="module")
def reports(tiny_moe_dir):
    tp_ep = {"tp": 2, "ep": 2, "sequence_parallel": True}
    routed = {"routing": (2, 4, 2), "n": 4}
    jobs = [
        {
            "hf_dir": tiny_moe_dir,
            "layout": tp_ep,
            "checks": [{"routing": "r3", "groups": routed}, {"route": "mask", "groups": routed}],
        },
        {"hf_dir": tiny_moe_dir, "layout": {"pp": 2}, "checks": [{"groups": {"n": 4}}]},
    ]
    return run_parity(jobs, 2)


@pytest.mark.parametrize(
    ("job", "check"), [(0, 0), (0, 1), (1, 0)], ids=["tp2ep2_r3", "tp2ep2_mask", "pp2"]
)
def test_shared_equals_rows_under_layouts(reports, job, check):
    last = [r for r in reports[job] if r["is_last_stage"]]
    for rank in last:  # every last-stage rank (its data-parallel share, the gathered grads)
        res = rel_diffs(rank["checks"][check][False], rank["checks"][check][True])
        for key in ("logprobs", "loss", "grads"):
            assert res[key] <= FP32, f"{key}: {res[key]:.3g}"
        assert res["grad_min_scale"] > 0
