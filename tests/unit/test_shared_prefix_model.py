"""Shared prefix through the real Megatron policy on one process (issue 43 item 2): the
trainer's shared path against its rows on the same batch, on the tiny dense and tiny MoE
models: logits at the completion positions, per-token log-probs, the loss and every LoRA
gradient, by both attention routes (the local spec's mask; the TE route's THD index with a
torch stand-in for TE's kernel), with R3 replay, the logits head and the fused-linear head,
packing, partial-rollout tokens (engine log-probs of older policies, importance weights),
fp32 and bf16; and that no completion sees another.

Tolerances. fp32: 1e-5 relative (measured: log-probs and logits 1e-7 to 4e-7, loss below
1e-7, LoRA gradients 7e-7 to 3.3e-6 of each tensor's largest entry: the two paths differ
only in the order of reductions, e.g. an attention row of the segment row sums exact zeros
for the keys it masks). bf16: every layer rounds its output to bf16 (eps 2^-7 = 7.8e-3), so
a different reduction order flips last bits that propagate through the layers: bounded at
4 eps (3.1e-2) relative for the log-probs, the loss and the gradients as a whole (the norm of
their differences over theirs: measured 7.9e-3, one eps; the log-probs, computed in fp32 from
the same bf16 hidden states, did not move). The faults these checks exist for (a leak
between completions, positions restarting at 0) move log-probs by 1e-2 to 1 (the last test).
"""

from __future__ import annotations

import pytest
import torch
from prefix_parity import _Path, make_groups, per_sample, rel_diffs, run_parity

from megagrpo.model.shared_prefix import Segments

FP32 = 1e-5
BF16 = 4 * torch.finfo(torch.bfloat16).eps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _assert_close(res: dict, rtol: float, what: str) -> None:
    for key in ("logprobs", "logits", "loss", "grads"):
        if key in res:
            assert res[key] <= rtol, f"{what}: {key} differs by {res[key]:.3g} (> {rtol:.1g})"
    assert res["grad_min_scale"] > 0, f"{what}: a LoRA gradient is zero: nothing compared"


def _checks(report: dict) -> list[dict]:
    return [rel_diffs(c[False], c[True]) for c in report["checks"]]


def test_dense_shared_equals_rows(tiny_dense_dir):
    """Dense Qwen3 by the local spec's THD route (the default): fused-linear head with the
    logits compared, the logits head with GRPO's per-sequence mean; then megatron's own
    attention under the segments' mask, and the THD index with the dense stand-in kernel."""
    checks = [
        {"logits": True},
        {"fused_linear": False, "loss": {"variant": "grpo"}, "groups": {"seed": 1}},
        {"route": "mask", "groups": {"seed": 2}, "logits": True},
        {"route": "ref", "groups": {"seed": 3}},
    ]
    (report,) = run_parity([{"hf_dir": tiny_dense_dir, "layout": {}, "checks": checks}], 1)[0]
    for i, res in enumerate(_checks(report)):
        _assert_close(res, FP32, f"dense check {i}")


def test_moe_shared_equals_rows_with_r3_packing_and_partial_rollouts(tiny_moe_dir):
    """Qwen3-MoE (4 experts, top-2): R3 replaying the engine's experts (the prompt's
    routing once) by the THD and the mask routes; partial-rollout tokens (recomputed
    behaviour log-probs, importance weights against the engine's, GSPO's sequence ratio) in
    packed rows of 48 tokens, where the groups that do not fit train as rows."""
    routed = {"routing": (2, 4, 2)}
    checks = [
        {"routing": "r3", "groups": routed, "logits": True},
        {"routing": "r3", "groups": {**routed, "seed": 4}, "route": "mask"},
        {
            "old": "recompute",
            "loss": {"variant": "gspo", "tis_cap": 2.0},
            "pack_tokens": 48,
            "groups": {"n": 4, "seed": 5},
        },
    ]
    (report,) = run_parity([{"hf_dir": tiny_moe_dir, "layout": {}, "checks": checks}], 1)[0]
    for i, res in enumerate(_checks(report)):
        _assert_close(res, FP32, f"moe check {i}")
    packed = report["checks"][2]
    assert packed[True]["micro_batches"] >= 2  # several rows, some groups as rows
    assert packed[True]["row_tokens"] < packed[False]["row_tokens"]


def test_bf16_shared_equals_rows(tiny_moe_dir):
    (report,) = run_parity(
        [{"hf_dir": tiny_moe_dir, "layout": {}, "dtype": "bfloat16", "checks": [{}]}], 1
    )[0]
    res = rel_diffs(report["checks"][0][False], report["checks"][0][True])
    for key in ("logprobs", "loss", "grads_norm"):
        assert res[key] <= BF16, f"{key}: {res[key]:.3g}"


@pytest.fixture(scope="module")
def moe_policy(tiny_moe_dir):
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    pgs = init_parallel(ParallelConfig())
    policy = build_policy(ModelConfig(hf_path=str(tiny_moe_dir), lora=LoraConfig(rank=4)), pgs)
    yield policy, pgs
    destroy_parallel()


def _logprobs(policy, pgs, groups, shared: bool) -> dict[int, torch.Tensor]:
    policy.prefix_route = "mask"  # what the leaky mask below breaks
    path = _Path(policy, pgs, {}, groups, shared)
    return per_sample(path.mbs, path.logprobs())


def _moved(a: dict, b: dict, keys) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in keys if a[k].numel())


def _leaky_mask(self, device=None):
    """Broken on purpose: a completion also sees the completions before it (one causal
    block per prompt and its completions)."""
    seg = self.segment_ids(device)
    root = torch.tensor([s if p < 0 else p for s, p in enumerate(self.parent)], device=device)
    r = root[seg]
    t = seg.numel()
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return ~((r[:, None] == r[None, :]) & causal)[None, None]


def _restarting_positions(self, device=None):
    """Broken on purpose: every segment's positions restart at 0."""
    return torch.cat([torch.arange(self.length(s), device=device) for s in range(len(self.parent))])


def test_one_completion_cannot_see_another(moe_policy, monkeypatch):
    """Perturbing one completion's tokens moves its own log-probs and no other's; the same
    check catches a mask that lets completions see each other, and positions restarting at
    0 make the shared log-probs differ from the rows'."""
    policy, pgs = moe_policy
    vocab = policy.arch.vocab_size
    groups = make_groups(vocab, n=2, g=4, seed=7, completion=(3, 10))
    victim = groups[0].token_ids[1]
    others = [i for i in range(8) if i != 1]

    def perturbed():
        g2 = make_groups(vocab, n=2, g=4, seed=7, completion=(3, 10))
        g2[0].token_ids[1] = [(t + 7) % vocab for t in victim]
        return g2

    base = _logprobs(policy, pgs, groups, True)
    after = _logprobs(policy, pgs, perturbed(), True)
    rows = _logprobs(policy, pgs, groups, False)
    tol = FP32 * max(float(v.abs().max()) for v in rows.values() if v.numel())
    assert _moved(base, after, others) <= tol
    assert _moved(base, after, [1]) > 1e-2
    assert _moved(base, rows, range(8)) <= tol

    monkeypatch.setattr(Segments, "mask", _leaky_mask)
    leak_base = _logprobs(policy, pgs, groups, True)
    leak_after = _logprobs(policy, pgs, perturbed(), True)
    assert _moved(leak_base, leak_after, [2, 3]) > 1e-3  # completions after the victim move
    monkeypatch.undo()

    monkeypatch.setattr(Segments, "positions", _restarting_positions)
    wrong = _logprobs(policy, pgs, groups, True)
    assert _moved(wrong, rows, range(8)) > 1e-2
