"""`megagrpo preflight`'s pure parts: the truncated HF config, the layer count under PP, the
full-depth extrapolation (closed-form numbers), the report's shape and the text table."""

from __future__ import annotations

import json

import pytest

from megagrpo.commands.preflight import (
    build_report,
    extrapolate,
    format_report,
    preflight_layers,
    truncated_hf_config,
)
from megagrpo.preflight.phases import PHASES


def test_truncation_keeps_widths_and_experts():
    hf = {
        "num_hidden_layers": 94,
        "hidden_size": 4096,
        "num_experts": 128,
        "mlp_only_layers": [0, 5, 90],
        "layer_types": ["full_attention"] * 94,
        "max_window_layers": 94,
    }
    out = truncated_hf_config(hf, 2)
    assert out["num_hidden_layers"] == 2 and out["hidden_size"] == 4096
    assert out["num_experts"] == 128 and out["mlp_only_layers"] == [0]
    assert len(out["layer_types"]) == 2 and out["max_window_layers"] == 2
    assert hf["num_hidden_layers"] == 94  # the input is left alone


@pytest.mark.parametrize(
    ("requested", "pp", "full", "expected"),
    [(2, 1, 94, 2), (2, 4, 94, 4), (5, 4, 94, 8), (2, 1, 1, 1), (3, 2, 48, 4)],
)
def test_layers_rounded_to_pipeline_stages(requested, pp, full, expected):
    assert preflight_layers(requested, pp, full) == expected


def test_layers_must_be_positive():
    with pytest.raises(ValueError, match="--layers"):
        preflight_layers(0, 1, 10)


def test_extrapolation_adds_the_planners_per_layer_slope():
    # plan: 10 GiB at 2 layers, 102 GiB at 94 -> 1 GiB a layer; measured 12 at 2 layers
    out = extrapolate(12.0, 10.0, 102.0, 2, 94)
    assert out["slope_gib_per_layer"] == pytest.approx(1.0)
    assert out["extrapolated_gib"] == pytest.approx(12.0 + 92 * 1.0)
    assert extrapolate(3.0, 1.0, 1.0, 4, 4) == {"slope_gib_per_layer": 0.0, "extrapolated_gib": 3.0}


def _phases(fail: str | None = None) -> list[dict]:
    out = []
    for name in PHASES:
        ok = name != fail
        out.append(
            {"name": name, "ok": ok, "seconds": 1.5, "peak_gib": 2.0, "error": "" if ok else "X: y"}
        )
        if not ok:
            break
    return out


def test_report_shape_and_json_round_trip():
    plan_n = {"startup": 1.0, "generate": 1.5, "train": 0.5, "sync": 1.2}
    plan_full = {"startup": 47.0, "generate": 70.5, "train": 23.5, "sync": 56.2}
    report = build_report(_phases(), plan_n, plan_full, 2, 94, 16, "RSS high-water")
    assert report["ok"] and report["failed_phase"] is None
    assert [p["name"] for p in report["phases"]] == list(PHASES)
    assert set(report["memory"]) == {"start", "generate", "train", "sync"}
    train = report["memory"]["train"]
    assert train["slope_gib_per_layer"] == pytest.approx(23.0 / 92)
    assert train["extrapolated_gib"] == pytest.approx(2.0 + 23.0)
    assert json.loads(json.dumps(report)) == report
    text = format_report(report)
    assert "preflight passed: all 10 phases" in text and "train" in text


def test_report_names_the_failed_phase():
    report = build_report(_phases("sync"), {}, {}, 2, 94, 2, "RSS high-water")
    assert not report["ok"] and report["failed_phase"] == "sync" and report["error"] == "X: y"
    assert "preflight FAILED in phase sync: X: y" in format_report(report)
    gate = build_report([], {}, {}, 2, 94, 2, "x", violations=["rule r: keys"])
    assert gate["failed_phase"] == "compat" and not gate["ok"]
