"""Pipeline parallelism in training (issue 15 item 5): Megatron's schedule through
``MegatronPolicy.forward_backward`` equals one stage.

A tiny Qwen3-MoE with 4 layers (2 per stage) runs two GRPO steps per layout: the scoring
pass (old log-probs, forward only, kept on the last stage), the training pass (the fused
loss of length-sorted, differently shaped micro-batches, weighted as the trainer weighs
them) and an SGD step. Against the single-process run: the per-micro-batch loss metrics on
*every* stage (broadcast from the last), the full LoRA gradients of both steps (A's are
non-zero at step 2), the old log-probs on the last stage.
"""

from __future__ import annotations

import pytest
import torch

from megagrpo.testing import scaled_tol

pytestmark = pytest.mark.distributed

STEPS = 2
# The layouts below split no reduction of a single output (PP moves whole layers; EP moves
# whole experts; DP averages identical copies), so grads agree to rounding; TP2 splits the
# vocab/hidden reductions: 256 ulps of the values' scale (tests/distributed/test_model_layouts)
ULPS = {"pp2": 64, "pp2_recompute": 64, "pp2_ep2": 64, "pp2_tp2": 256}


def _samples(vocab: int, n: int = 7, seed: int = 0):
    """Samples of different prompt/completion lengths (the trainer's ``Sample``)."""
    from megagrpo.trainer.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(3, 7, (1,), generator=g))
        c = int(torch.randint(1, 10, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        out.append(Sample(ids, p, float(torch.randn(1, generator=g)), [], i))
    return out


@pytest.fixture(scope="module")
def moe4_dir(tmp_path_factory, tiny_tokenizer_dir):
    from megagrpo.testing import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_moe4")
    return build_tiny_model(out, "moe", tokenizer_dir=tiny_tokenizer_dir, num_hidden_layers=4)


@pytest.fixture(scope="module")
def mbs():
    from megagrpo.trainer.batch import micro_batches

    batches = list(micro_batches(_samples(500), 3, pad_id=0))
    assert len({tuple(mb.input_ids.shape) for mb in batches}) > 1  # shapes differ
    return batches


def _job(moe4_dir, mbs, layout, **kw):
    return dict(hf_dir=moe4_dir, layout=layout, mbs=mbs, steps=STEPS, lr=0.5, **kw)


@pytest.fixture(scope="module")
def runs(moe4_dir, mbs):
    from verify_pipeline import run_grpo_passes

    grpo = {"loss": {"variant": "grpo"}, "model": {"recompute": "full"}}
    ref, ref_recompute = run_grpo_passes(
        [_job(moe4_dir, mbs, {}), _job(moe4_dir, mbs, {}, **grpo)], 1
    )
    two = run_grpo_passes(
        [_job(moe4_dir, mbs, {"pp": 2}), _job(moe4_dir, mbs, {"pp": 2}, **grpo)], 2
    )
    return {
        "w1": ref[0],
        "w1_recompute": ref_recompute[0],
        "pp2": two[0],
        "pp2_recompute": two[1],
    }


@pytest.fixture(scope="module")
def runs4(moe4_dir, mbs):
    from verify_pipeline import run_grpo_passes

    four = run_grpo_passes(
        [
            _job(moe4_dir, mbs, {"pp": 2, "ep": 2}),
            _job(moe4_dir, mbs, {"pp": 2, "tp": 2, "sequence_parallel": True}),
        ],
        4,
    )
    return {"pp2_ep2": four[0], "pp2_tp2": four[1]}


def _check(reports: list[dict], ref: dict, name: str) -> None:
    ulps = ULPS[name]
    stages = {r["pp_rank"] for r in reports}
    assert stages == {0, 1}, name
    for r in reports:  # every stage: the last stage's metrics, broadcast
        for got, want in zip(r["metrics"], ref["metrics"], strict=True):
            assert len(got) == len(want)
            for g_mb, w_mb in zip(got, want):
                assert g_mb.keys() == w_mb.keys()
                for k in ("loss/policy", "loss/entropy", "loss/total"):
                    w = torch.tensor(w_mb[k], dtype=torch.float32)
                    assert abs(g_mb[k] - w_mb[k]) <= scaled_tol(w, ulps), (name, k)
    r0 = reports[0]
    for step in range(STEPS):
        got, want = r0["grads"][step], ref["grads"][step]
        assert got.keys() == want.keys()
        scale = max(t.abs().max().item() for pair in want.values() for t in pair)
        tol = scaled_tol(torch.tensor(scale), ulps)
        diff = max((a - b).abs().max().item() for k in want for a, b in zip(got[k], want[k]))
        assert diff <= tol, f"{name} step {step}: grad diff {diff:.3g} > {tol:.3g}"
    # step 2 has non-zero A gradients (B moved at step 1), so both factors are compared
    assert all(a.abs().max() > 0 for a, _ in ref["grads"][1].values())
    for r in reports:  # old log-probs live where they are used: the last stage
        if not r["is_last_stage"]:
            assert all(o is None for step in r["old"] for o in step)
            continue
        for got, want in zip(r["old"], ref["old"]):
            for a, b in zip(got, want):
                assert (a - b).abs().max().item() <= scaled_tol(b, ulps), name


@pytest.mark.parametrize("name", ["pp2", "pp2_recompute"])
def test_pp2_equals_one_stage(runs, name):
    ref = runs["w1_recompute" if name.endswith("recompute") else "w1"]
    _check(runs[name], ref, name)


@pytest.mark.parametrize("name", ["pp2_ep2", "pp2_tp2"])
def test_pp_with_ep_or_tp_on_four_ranks(runs, runs4, name):
    _check(runs4[name], runs["w1"], name)


def test_forward_logits_refuses_pp(moe4_dir):
    """One stage has no logits under PP: the error names the method to use."""
    from megagrpo.model.policy import MegatronPolicy

    class _G:
        pp_size = 2

    policy = MegatronPolicy.__new__(MegatronPolicy)
    torch.nn.Module.__init__(policy)
    policy.groups = _G()  # type: ignore[assignment]
    with pytest.raises(NotImplementedError, match="forward_backward"):
        policy.forward_logits(torch.zeros(1, 4, dtype=torch.long))
