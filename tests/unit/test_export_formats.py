"""`megagrpo export RUN --adapter --format peft|vllm` of a tiny Qwen3-MoE checkpoint (LoRA on
attention and every expert), and `megagrpo eval --adapter` serving either (audit 3 B1).

References: peft itself (``PeftModel.from_pretrained`` of the ``--format peft`` directory on
the transformers model: fused experts through ``target_parameters``) and the engines' own
view of the adapter (``peft_state``: what every adapter sync hands vLLM; vLLM 0.33 loading
the ``--format vllm`` directory is tests/contract/test_vllm_adapter.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from lora_pieces import whole_lora_pieces

from megagrpo.checkpoint import format as checkpoint
from megagrpo.cli import main
from megagrpo.model.config import LoraConfig
from megagrpo.testing import EMPTY_SAMPLER_STATE

LORA = LoraConfig(rank=4, alpha=8.0)
IDS = list(range(100, 130))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_moe_dir):
    """``{"peft": dir, "vllm": dir}`` of one checkpoint of random LoRA pieces."""
    tmp = tmp_path_factory.mktemp("export_formats")
    pieces = whole_lora_pieces(tiny_moe_dir, LORA)
    gen = torch.Generator().manual_seed(0)
    for p in pieces:
        p["param"] = torch.randn(p["param"].shape, generator=gen) * 0.2
    checkpoint.save(
        tmp / "run" / "checkpoints",
        1,
        rank=0,
        world_size=1,
        rank_state={"pieces": pieces, "optimizer_groups": [], "scheduler": None},
        trainer_state={"sampler": EMPTY_SAMPLER_STATE, "dynamic": {}, "loop": {}},
        meta={},
        extra={
            "lora_layout": checkpoint.LAYOUT_FREE,
            "config": {"model": {"hf_path": str(tiny_moe_dir), "lora": {"rank": 4, "alpha": 8.0}}},
        },
    )
    out = {}
    for fmt in ("peft", "vllm"):
        out[fmt] = tmp / fmt
        args = ["export", str(tmp / "run"), "--adapter", "--format", fmt, "--out", str(out[fmt])]
        assert main(args) == 0
    return out


def _logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([IDS])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def peft_reference(exported, tiny_moe_dir) -> torch.Tensor:
    """peft's log-probs of :data:`IDS` with the ``--format peft`` adapter (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    before = _logprobs(base)
    model = PeftModel.from_pretrained(base, str(exported["peft"])).eval()
    after = _logprobs(model)
    assert float((after - before).abs().max()) > 1e-2  # the adapter moves the model
    return after


def test_vllm_format_is_what_the_engines_receive(exported):
    """Per-expert keys, no target_parameters, the same factors as the peft layout unfused,
    config and names as the engines' ``peft_state``."""
    from safetensors.torch import load_file

    from megagrpo.rollout.lora import peft_state, read_peft_adapter, unfuse_experts

    vllm = load_file(str(exported["vllm"] / "adapter_model.safetensors"))
    conf = json.loads((exported["vllm"] / "adapter_config.json").read_text())
    assert "target_parameters" not in conf and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    experts = [k for k in vllm if ".experts." in k]
    assert experts and all(
        re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.lora_[AB]\.weight$", k)
        for k in experts
    )
    peft_conf = json.loads((exported["peft"] / "adapter_config.json").read_text())
    assert peft_conf["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    fused = load_file(str(exported["peft"] / "adapter_model.safetensors"))
    unfused = unfuse_experts(fused, peft_conf["target_parameters"], 4)
    assert set(unfused) == set(vllm)
    for k, t in vllm.items():
        assert torch.equal(t, unfused[k].to(t.dtype)), k
    engine_view, engine_conf, _ = peft_state(read_peft_adapter(exported["vllm"]))
    assert set(engine_view) == set(vllm) and engine_conf == conf


@pytest.mark.parametrize("fmt", ["peft", "vllm"])
def test_eval_adapter_serves_a_moe_adapter(exported, tiny_moe_dir, peft_reference, fmt):
    """``megagrpo eval --adapter`` on a MoE model: either format (cd819e6 refused the fused
    one, "cannot be applied to the rollout engine yet"), and the engine then scores what
    peft scores."""
    from megagrpo.commands.eval import apply_adapter
    from megagrpo.rollout import RolloutConfig, build_engine

    cfg = RolloutConfig(engine="hf", max_model_len=256, max_tokens=8, dtype="float32")
    engine = build_engine(cfg, str(tiny_moe_dir))
    try:
        info = apply_adapter(engine, exported[fmt], tiny_moe_dir)
        got = torch.tensor(engine.sequence_logprobs(IDS), dtype=torch.float64)
    finally:
        engine.close()
    assert info["applied"] and info["modules"] == 2 * (4 + 4 * 3)  # q k v o + 4 x gate up down
    assert float((got - peft_reference).abs().max()) < 1e-4  # fp32 merge vs peft's forward
