"""Megatron policy at world size 1 against transformers' own models (fp32, CPU/gloo)."""

from __future__ import annotations

import glob

import pytest
import torch

from megagrpo.errors import CheckpointError, ConfigError
from megagrpo.model.arch import arch_from_hf, load_hf_config, param_counts
from megagrpo.model.config import LoraConfig, ModelConfig
from megagrpo.parallel import ParallelConfig, validate_layout
from megagrpo.testing import assert_close_scaled


@pytest.fixture(scope="module")
def groups():
    from megagrpo.parallel import destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig())
    yield g
    destroy_parallel()


def _ids(vocab=500, shape=(2, 13), seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Llama with tied embeddings (like SmolLM2-135M), head_dim 32, GQA, no qk-norm."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["moe", "dense", "llama"])
def test_logits_match_transformers_and_roundtrip(
    kind, groups, tiny_moe_dir, tiny_dense_dir, tiny_llama_dir
):
    from safetensors.torch import load_file

    from megagrpo.model import build_policy

    path = {"moe": tiny_moe_dir, "dense": tiny_dense_dir, "llama": tiny_llama_dir}[kind]
    policy = build_policy(ModelConfig(hf_path=str(path)), groups)
    ids = _ids()
    with torch.no_grad():
        logits = policy.forward_logits(ids)
    ref = _hf_logits(path, ids)
    assert logits.shape == ref.shape
    assert_close_scaled(logits, ref, ulps=256, what="Megatron vs transformers logits")
    # B = 0 at init: the adapters do not change the logits, and only they are trainable
    assert policy.lora_parameters()
    assert all(p.requires_grad == (".adapter." in n) for n, p in policy.model.named_parameters())
    # HF -> import -> export is bitwise
    orig = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        orig.update(load_file(f))
    orig.pop("lm_head.weight", None) if kind == "llama" else None
    exported = {k: t for b in policy.export_hf_weights(bucket_bytes=1 << 15) for k, t in b}
    assert exported.keys() == orig.keys()
    assert all(torch.equal(exported[k], orig[k]) for k in orig)


def test_attention_mask_and_positions(groups, tiny_moe_dir):
    from megagrpo.model import build_policy

    policy = build_policy(ModelConfig(hf_path=str(tiny_moe_dir)), groups)
    ids = _ids(shape=(1, 9))
    with torch.no_grad():
        full = policy.forward_logits(ids)
        # right padding: a mask over the padded tail leaves the real tokens' logits unchanged
        padded = torch.cat([ids, torch.zeros(1, 3, dtype=ids.dtype)], dim=1)
        mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 3)], dim=1)
        masked = policy.forward_logits(padded, attention_mask=mask)
        assert_close_scaled(masked[:, :9], full, what="masked right padding")
        pos = torch.arange(9).unsqueeze(0)
        assert torch.equal(policy.forward_logits(ids, position_ids=pos), full)
    with pytest.raises(ValueError, match="position_ids"):
        policy.forward_logits(ids, position_ids=pos + 1)


def test_lora_state_dict_roundtrip_and_errors(groups, tiny_moe_dir):
    from megagrpo.model import build_policy

    cfg = ModelConfig(hf_path=str(tiny_moe_dir), lora=LoraConfig(rank=4, alpha=8.0))
    policy = build_policy(cfg, groups)
    with torch.no_grad():
        for p in policy.lora_parameters():
            p.normal_(0, 0.05)
    sd = policy.lora_state_dict()
    ids = _ids(shape=(1, 7))
    with torch.no_grad():
        before = policy.forward_logits(ids)
    other = build_policy(cfg, groups)
    other.load_lora_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(other.forward_logits(ids), before)
    bad = dict(sd)
    bad.pop(next(iter(bad)))
    with pytest.raises(CheckpointError, match="missing"):
        other.load_lora_state_dict(bad)


def test_bad_checkpoints_name_the_tensor(groups, tiny_moe_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from megagrpo.model import build_policy

    sd = load_file(f"{tiny_moe_dir}/model.safetensors")
    for name, mutate in [
        ("missing", lambda d: d.pop("model.layers.1.mlp.experts.3.up_proj.weight")),
        ("shape", lambda d: d.__setitem__("model.norm.weight", torch.ones(3))),
        ("unknown", lambda d: d.__setitem__("model.extra.weight", torch.ones(2))),
    ]:
        d = tmp_path / name
        shutil.copytree(tiny_moe_dir, d)
        bad = dict(sd)
        mutate(bad)
        save_file(bad, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError) as err:
            build_policy(ModelConfig(hf_path=str(d)), groups)
        assert {
            "missing": "up_proj",
            "shape": "model.norm.weight",
            "unknown": "model.extra.weight",
        }[name] in str(err.value)


def test_validate_layout_names_the_key(tiny_moe_dir):
    hf = load_hf_config(tiny_moe_dir)
    validate_layout(ParallelConfig(tp=2, ep=2, sequence_parallel=True), hf, 4)
    cases = [
        (ParallelConfig(tp=2, sequence_parallel=True), 3, "parallel.tp"),
        (ParallelConfig(ep=3), 3, "num_experts=4"),
        (ParallelConfig(tp=8, sequence_parallel=True), 8, "num_attention_heads"),
        (ParallelConfig(tp=4, sequence_parallel=True), 4, "num_key_value_heads"),
        (ParallelConfig(tp=2), 2, "parallel.sequence_parallel"),
        (ParallelConfig(pp=3), 3, "num_hidden_layers"),
    ]
    for cfg, world, needle in cases:
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            validate_layout(cfg, hf, world)


def test_param_counts_closed_form(tiny_moe_dir):
    """Closed-form counts equal transformers' own parameter count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    counts = param_counts(arch_from_hf(load_hf_config(tiny_moe_dir)))
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    a = arch_from_hf(load_hf_config(tiny_moe_dir))
    inactive = (
        a.num_layers * (a.num_experts - a.moe_topk) * 3 * a.hidden_size * a.moe_ffn_hidden_size
    )
    assert counts["active"] == counts["total"] - inactive
