"""Megatron policy under gloo layouts (2 and 4 processes) against transformers and world 1.

One launch per layout (module-scoped): logits vs transformers, bitwise HF round trip,
zero-init LoRA, LoRA gradients over two SGD steps vs the single-process run, and a PEFT
adapter / merged export after training reproduced by transformers (+ peft).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from megagrpo.testing import assert_close_scaled

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name -> (layout, world size)
    "tp2": (dict(tp=2, sequence_parallel=True), 2),
    "ep2": (dict(ep=2), 2),
    "tp2ep2": (dict(tp=2, ep=2, sequence_parallel=True), 4),
    "dense_tp2": (dict(tp=2), 2),
    "tp2etp2": (dict(tp=2, etp=2, sequence_parallel=True), 2),  # experts split over ETP
}
LOGIT_ULPS = 256  # another implementation / layout of the same fp32 math (testing.scaled_tol)
JOB = dict(train_steps=2, lr=0.05, lora={"rank": 4, "alpha": 8.0})


@pytest.fixture(scope="module")
def ids():
    from megagrpo.model.verify import fixed_inputs

    return fixed_inputs(500, batch=2, seq=11)


@pytest.fixture(scope="module")
def runs(tiny_moe_dir, tiny_dense_dir, ids, tmp_path_factory):
    """Two launches: 2 processes (TP2+SP, EP2, dense TP2 without SP, TP2 x expert-TP2, one
    after another in the same ranks) and 4 processes (TP2xEP2); plus the 1-process runs."""
    from megagrpo.model.verify import run_layout, run_layouts

    out = {
        "w1": run_layout(tiny_moe_dir, {}, 1, ids, **JOB),
        "dense_w1": run_layout(tiny_dense_dir, {}, 1, ids, **JOB),
    }
    two = [
        ("tp2", tiny_moe_dir),
        ("ep2", tiny_moe_dir),
        ("dense_tp2", tiny_dense_dir),
        ("tp2etp2", tiny_moe_dir),
    ]
    reports = run_layouts(
        [dict(JOB, hf_dir=d, layout=LAYOUTS[n][0], input_ids=ids) for n, d in two], 2
    )
    out.update({n: r for (n, _), r in zip(two, reports)})
    adapter = tmp_path_factory.mktemp("adapter") / "peft"
    out["tp2ep2"] = run_layout(
        tiny_moe_dir, LAYOUTS["tp2ep2"][0], 4, ids, **JOB, adapter_dir=str(adapter), merged_dir="1"
    )
    return out


@pytest.fixture(scope="module")
def reference(tiny_moe_dir, ids):
    from megagrpo.model.verify import hf_reference_logits

    return hf_reference_logits(str(tiny_moe_dir), ids)


def _max_grad_diff(a, b):
    diff = scale = 0.0
    for step_a, step_b in zip(a, b):
        assert step_a.keys() == step_b.keys()
        for k in step_a:
            for x, y in zip(step_a[k], step_b[k]):
                diff = max(diff, (x - y).abs().max().item())
                scale = max(scale, y.abs().max().item())
    return diff, scale


@pytest.fixture(scope="module")
def dense_reference(tiny_dense_dir, ids):
    from megagrpo.model.verify import hf_reference_logits

    return hf_reference_logits(str(tiny_dense_dir), ids)


@pytest.mark.parametrize("name", ["w1", *LAYOUTS])
def test_logits_roundtrip_and_zero_lora(runs, reference, dense_reference, name):
    r = runs[name]
    ref = dense_reference if name.startswith("dense") else reference
    assert_close_scaled(r["logits"], ref, LOGIT_ULPS, name)
    assert r["lora_zero_init_max_diff"] == 0.0
    assert r["roundtrip_bitwise"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_grads_agree_with_single_process(runs, name):
    w1 = runs["dense_w1" if name.startswith("dense") else "w1"]
    diff, scale = _max_grad_diff(runs[name]["grads"], w1["grads"])
    assert scale > 1e-3  # both steps have non-trivial gradients (A's too, at step 2)
    assert diff <= 1e-5 * scale
    assert all(a.abs().max() > 0 for a, _ in w1["grads"][1].values())
    trained = runs[name]["trained_logits"]
    assert_close_scaled(trained, w1["trained_logits"], LOGIT_ULPS, name)


def test_peft_adapter_after_training_reproduces_megatron(runs, tiny_moe_dir, ids, reference):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r = runs["tp2ep2"]
    trained = r["trained_logits"]
    assert (trained - reference).abs().max().item() > 1e-2  # training moved the logits
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, r["adapter_dir"]).eval()
    with torch.no_grad():
        logits = model(ids).logits
    assert_close_scaled(logits, trained, LOGIT_ULPS, "peft vs megatron")


def test_merged_export_after_training_loads_in_transformers(runs, tiny_moe_dir, ids, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    shutil.copytree(tiny_moe_dir, out)
    save_file(runs["tp2ep2"]["merged"], str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
    assert_close_scaled(logits, runs["tp2ep2"]["trained_logits"], LOGIT_ULPS, "merged export")
