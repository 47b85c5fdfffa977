"""`megagrpo eval --adapter DIR` reads a PEFT adapter as peft applies it, or names what is
wrong (red team 4, N15, N17): ``r`` against the tensors, peft's ``rank_pattern`` /
``alpha_pattern``, shapes against the base model, NaN / inf and an overflowing alpha.

Reference: peft itself (``get_delta_weight`` of every LoRA layer of the same directory loaded
by ``PeftModel.from_pretrained`` on the transformers model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megagrpo.commands.eval import load_adapter
from megagrpo.errors import ConfigError

TARGETS = ["q_proj", "v_proj", "o_proj"]


def _peft_dir(out: Path, model_dir: Path, targets=TARGETS, **patterns) -> Path:
    """A peft LoRA of the tiny dense model with random A and B, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **patterns)
    get_peft_model(base, cfg).save_pretrained(str(out))
    return out


def _peft_deltas(adapter_dir: Path, model_dir: Path) -> dict[str, torch.Tensor]:
    """``{module: delta W}`` as peft computes it for the saved directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    out = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            out[name] = module.get_delta_weight("default").detach().float()
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_dense_dir) -> Path:
    return _peft_dir(tmp_path_factory.mktemp("plain") / "a", tiny_dense_dir)


def _copy(src: Path, dst: Path, **conf) -> Path:
    shutil.copytree(src, dst)
    body = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**body, **conf}))
    return dst


def _tensors(adapter: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    f = adapter / "adapter_model.safetensors"
    state = load_file(str(f))
    change(state)
    save_file(state, str(f))


def test_rank_and_alpha_patterns_are_applied_as_peft_applies_them(tmp_path, tiny_dense_dir):
    """``alpha_pattern`` / ``rank_pattern`` were ignored: every module at ``lora_alpha / r``
    (q_proj 8x too weak here, v_proj at half its scale)."""
    adapter_dir = _peft_dir(
        tmp_path / "a", tiny_dense_dir, alpha_pattern={"q_proj": 64}, rank_pattern={"v_proj": 2}
    )
    reference = _peft_deltas(adapter_dir, tiny_dense_dir)
    adapter = load_adapter(adapter_dir)
    assert set(adapter.a) == set(reference) and len(reference) == 2 * len(TARGETS)
    for module, want in reference.items():
        got = adapter.delta(module)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), module  # fp32, two orders


def test_an_r_that_disagrees_with_the_tensors_is_named(plain, tmp_path):
    """``"r": 100000`` on rank-4 tensors was served at alpha / 100000 (25,000x weaker)."""
    bad = _copy(plain, tmp_path / "r", r=100000)
    with pytest.raises(ConfigError, match=r"not of rank 100000 \(adapter_config.json's r"):
        load_adapter(bad)
    assert load_adapter(plain).scale == 2.0  # the same tensors with their own r


def test_a_shape_mismatch_is_named_not_a_raw_matmul_error(plain, tmp_path, tiny_dense_dir):
    bad = _copy(plain, tmp_path / "shape")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _tensors(bad, lambda s: s.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(
        ConfigError, match=r"module model.layers.0.self_attn.q_proj: lora_A \(3, 3\)"
    ):
        load_adapter(bad)


def test_an_adapter_of_another_model_is_named(tmp_path, tiny_dense_dir, tiny_moe_dir):
    """A dense model's MLP adapter on the MoE (no dense MLP there), checked before any
    engine is built."""
    dense_mlp = _peft_dir(tmp_path / "mlp", tiny_dense_dir, targets=["down_proj"])
    assert len(load_adapter(dense_mlp, tiny_dense_dir).a) == 2
    with pytest.raises(ConfigError, match=r"mlp.down_proj is not a weight of the base model"):
        load_adapter(dense_mlp, tiny_moe_dir)


def test_nan_or_inf_in_an_adapter_is_named_as_the_adapters(plain, tmp_path):
    """N17: NaN tensors and ``lora_alpha: 1e308`` ended as "N engine parameters differ ...:
    a loader skipped or misplaced them", sending the user after the engine."""
    nan = _copy(plain, tmp_path / "nan")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _tensors(nan, lambda s: s[key].view(-1).__setitem__(0, float("nan")))
    with pytest.raises(ConfigError, match=rf"tensor {key} holds 1 NaN or infinite values"):
        load_adapter(nan)
    huge = _copy(plain, tmp_path / "huge", lora_alpha=1e308)
    with pytest.raises(ConfigError, match="overflows float32"):
        load_adapter(huge)
    with pytest.raises(ConfigError, match="'lora_alpha' must be a positive finite number"):
        load_adapter(_copy(plain, tmp_path / "neg", lora_alpha=-8))
