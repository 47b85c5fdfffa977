"""tools/convert_ckpt.py: HF -> Megatron shards (EP=2, 2 gloo ranks) -> HF bitwise; LoRA
checkpoints -> PEFT adapter / merged HF that peft / transformers reproduce; bad input."""

from __future__ import annotations

import glob
import importlib.util
import shutil

import pytest
import torch

from megagrpo.testing import assert_close_scaled

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def convert(repo_root):
    spec = importlib.util.spec_from_file_location(
        "convert_ckpt", repo_root / "tools" / "convert_ckpt.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        out.update(load_file(f))
    return out


def _hf_logits(path, ids, adapter=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(ids).logits


def test_import_export_ep2_roundtrips_bitwise(convert, tiny_moe_dir, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf_out"
    assert convert.main(["import", "--hf", str(tiny_moe_dir), "--out", str(ckpt), "--ep", "2"]) == 0
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == [
        "dense_tp0_pp0.safetensors",
        "expert_ep0_etp0_pp0.safetensors",
        "expert_ep1_etp0_pp0.safetensors",
    ]
    assert convert.main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    orig, back = _tensors(tiny_moe_dir), _tensors(out)
    assert orig.keys() == back.keys()
    assert all(torch.equal(orig[k], back[k]) for k in orig)
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_hf_logits(out, ids), _hf_logits(tiny_moe_dir, ids))
    assert not list(tmp_path.glob(".*tmp*"))  # temp dirs renamed or removed


def test_lora_checkpoint_to_adapter_and_merged(convert, tiny_moe_dir, tmp_path):
    from megagrpo.model import ModelConfig, build_policy
    from megagrpo.model.megatron_ckpt import save_policy_checkpoint
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    ids = torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(2))
    groups = init_parallel(ParallelConfig())
    try:
        policy = build_policy(ModelConfig(hf_path=str(tiny_moe_dir)), groups)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in policy.lora_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            want = policy.forward_logits(ids)
        save_policy_checkpoint(policy, tmp_path / "lora_ckpt", with_base=False)
    finally:
        destroy_parallel()
    assert (
        convert.main(
            [
                "export",
                "--ckpt",
                str(tmp_path / "lora_ckpt"),
                "--out",
                str(tmp_path / "adapter"),
                "--adapter-only",
            ]
        )
        == 0
    )
    assert (
        convert.main(
            [
                "export",
                "--ckpt",
                str(tmp_path / "lora_ckpt"),
                "--out",
                str(tmp_path / "merged"),
                "--merge-lora",
            ]
        )
        == 0
    )
    base = _hf_logits(tiny_moe_dir, ids)
    assert (want - base).abs().max() > 1e-2
    peft_logits = _hf_logits(tiny_moe_dir, ids, adapter=str(tmp_path / "adapter"))
    assert_close_scaled(peft_logits, want, 256, "PEFT adapter")
    assert_close_scaled(_hf_logits(tmp_path / "merged", ids), want, 256, "merged export")


def test_bad_input_names_the_problem(convert, tiny_moe_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_moe_dir, bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"][:8]
    save_file(sd, str(bad / "model.safetensors"))
    assert convert.main(["import", "--hf", str(bad), "--out", str(tmp_path / "o1")]) == 2
    assert "model.layers.0.self_attn.q_proj.weight" in capsys.readouterr().err
    assert (
        convert.main(
            ["import", "--hf", str(tiny_moe_dir), "--out", str(tmp_path / "o2"), "--ep", "3"]
        )
        == 2
    )
    assert "num_experts=4 is not divisible by ep=3" in capsys.readouterr().err
    assert convert.main(["export", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o3")]) == 2
    assert "megagrpo_ckpt.json" in capsys.readouterr().err
    (tmp_path / "o4").mkdir()
    (tmp_path / "o4" / "x").write_text("keep")
    assert convert.main(["import", "--hf", str(tiny_moe_dir), "--out", str(tmp_path / "o4")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
