"""``loss.fused_linear`` in training: the loss, metrics, old / reference log-probs and LoRA
gradients equal today's logits path, on one process (fp32 and bf16) and under TP2 with
sequence parallelism (gloo), and no ``[T, V/TP]`` tensor is ever made.

Each job runs the trainer's own pieces (``policy_logprobs``, ``model_output``,
``micro_batch_loss``) twice on the same tiny Qwen3-MoE with non-zero LoRA B (every adapter on
the gradient path): ``fused_linear`` off (the model's logits into the fused loss) and on (the
final hidden states and the output weight, chunk by chunk).

Tolerances: both paths compute each logit as the same dot product of the same hidden state
and output row, the gradient of the hidden states as the same ``dlogits @ W``; only the
blocking of the matmuls differs (a whole ``[T, V]`` product vs chunks of rows, [S, B] vs
[B, S] order), so fp32 results agree to reduction-order rounding: 256 fp32 ulps at the
values' scale (the same budget tests/distributed/test_pipeline.py allows a TP2 split). bf16:
the logits are rounded to bf16 in both paths (identically), but the hidden-state gradient is
a bf16 GEMM output in one and an fp32 accumulation cast once to bf16 in the other (<= 1 bf16
ulp apart per element); that difference travels back through two bf16 layers: 4 bf16 ulps
of the gradient's scale, 1 for the loss and log-probs (the forward is rounded identically).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.distributed

CHUNK_BYTES = 4096  # a few rows of logits per chunk: chunking really happens


class _LogitsRows(TorchDispatchMode):
    """Largest number of rows of any new op output whose last dimension is the local vocab."""

    def __init__(self, v_local: int) -> None:
        super().__init__()
        self.v_local, self.rows = v_local, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # W^T is a [H, V] view, no new memory
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.v_local:
                self.rows = max(self.rows, t.numel() // self.v_local)
        return out


def _samples(vocab: int, n: int = 6, seed: int = 0):
    from megagrpo.trainer.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(3, 7, (1,), generator=g))
        c = int(torch.randint(2, 10, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        out.append(Sample(ids, p, float(torch.randn(1, generator=g)), [], i))
    return out


def _one_path(policy, mbs, loss_kw: dict, fused: bool, temperature: float, tp) -> dict:
    from megagrpo.algo.config import LossConfig
    from megagrpo.model.peft_export import gather_lora
    from megagrpo.trainer.loss_head import micro_batch_loss, model_output
    from megagrpo.trainer.optimize import policy_logprobs

    cfg = LossConfig(
        **loss_kw, backend="torch", chunk_bytes=CHUNK_BYTES, fused_chunk_rows=1, fused_linear=fused
    )
    cfg.grad_in_logits = False  # keep the logits path's logits readable for the row count
    old = policy_logprobs(policy, mbs, cfg, tp, temperature=temperature)
    old = [  # off-policy: ratios differ from 1, some clip
        None if o is None else o + 0.05 * torch.sin(torch.arange(o.numel()).view_as(o) * 1.0)
        for o in old
    ]
    ref = policy_logprobs(policy, mbs, cfg, tp, base_only=True, temperature=temperature)
    v_local = policy.arch.vocab_size // policy.groups.tp_size
    rows = _LogitsRows(v_local)
    for p in policy.lora_parameters():
        p.grad = None
    with model_output(policy, cfg) as weight, rows:

        def loss_fn(output, i):
            loss, m = micro_batch_loss(output, weight, mbs[i], old[i], ref[i], cfg, tp, temperature)
            return loss, {k: float(v) for k, v in m.items()}

        metrics = policy.forward_backward(mbs, loss_fn)
    policy.finish_grad_sync()
    tokens = max(mb.input_ids.numel() for mb in mbs)
    return {
        "metrics": metrics,
        "old": [o.detach().cpu() for o in old if o is not None],  # last pipeline stage only
        "ref": [r.detach().cpu() for r in ref if r is not None],
        "last_stage": policy.groups.is_last_stage,
        "grads": gather_lora(policy, use_grad=True),
        "logits_rows": rows.rows,
        "tokens": tokens,
    }


def _worker(rank: int, hf_dir: str, jobs: list[dict]) -> list[dict]:
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.trainer.batch import micro_batches

    reports = []
    for n, job in enumerate(jobs):
        groups = init_parallel(ParallelConfig(**job["layout"]))
        try:
            lora = LoraConfig(
                rank=4, alpha=8.0, targets=["linear_qkv", "linear_proj", "linear_fc1"]
            )
            mcfg = ModelConfig(hf_path=hf_dir, lora=lora, dtype=job["dtype"])
            policy = build_policy(mcfg, groups)
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for name in sorted(policy.adapters):
                    b = policy.adapters[name].lora_B
                    b.copy_((torch.randn(b.shape, generator=gen) * 0.05).to(b.dtype))
            pad_to = groups.tp_size if groups.sequence_parallel else 1
            mbs = micro_batches(_samples(policy.arch.vocab_size), 3, 0, pad_to_multiple=pad_to)
            mbs = [mb.to(groups.device) for mb in mbs]
            tp = groups.tp if groups.tp_size > 1 else None
            reports.append(
                {
                    fused: _one_path(policy, mbs, job["loss"], fused, job["temperature"], tp)
                    for fused in (False, True)
                }
            )
        finally:
            destroy_parallel(keep_process_group=n < len(jobs) - 1)
    return reports


def _compare(report: dict, dtype: str) -> None:
    a, b = report[False], report[True]
    eps = torch.finfo(getattr(torch, dtype)).eps
    grad_ulps, fwd_ulps = (256, 256) if dtype == "float32" else (4, 1)
    # the logits path makes a [T, V/TP] tensor; the fused-linear path never more than a chunk
    if a["last_stage"]:
        assert a["logits_rows"] >= a["tokens"]
        assert 0 < b["logits_rows"] < a["tokens"]
    else:
        assert a["logits_rows"] == b["logits_rows"] == 0 and not a["old"] and not b["old"]
    for ma, mb in zip(a["metrics"], b["metrics"], strict=True):
        for k in ("loss/total", "loss/policy", "loss/kl", "loss/entropy", "loss/clip_frac"):
            assert abs(ma[k] - mb[k]) <= fwd_ulps * eps * max(1.0, abs(ma[k])), k
    for key in ("old", "ref"):
        for x, y in zip(a[key], b[key], strict=True):
            scale = max(1.0, x.abs().max().item())
            assert (x - y).abs().max().item() <= fwd_ulps * eps * scale, key
    assert a["grads"].keys() == b["grads"].keys()
    scale = max(g.abs().max().item() for pair in a["grads"].values() for g in pair)
    assert scale > 0
    for name, (ga, gb) in a["grads"].items():
        ha, hb = b["grads"][name]
        assert ga.abs().max() > 0, name  # every adapter is on the gradient path
        diff = max((ga - ha).abs().max().item(), (gb - hb).abs().max().item())
        assert diff <= grad_ulps * eps * scale, f"{name}: {diff:.3g} vs scale {scale:.3g}"


LOSSES = {
    "grpo_kl_entropy": {"variant": "grpo", "kl_coef": 0.05, "entropy_coef": 0.01},
    "gspo": {"variant": "gspo", "eps_low": 0.01, "eps_high": 0.02, "kl_coef": 0.05},
    "dr_grpo": {"variant": "dr_grpo", "kl_coef": 0.05, "entropy_coef": 0.01},
}


@pytest.mark.parametrize(
    "loss, dtype, temperature",
    [
        ("grpo_kl_entropy", "float32", 1.0),
        ("gspo", "float32", 0.6),
        ("dr_grpo", "bfloat16", 0.6),
    ],
)
def test_fused_linear_training_equals_logits_path_one_rank(tiny_moe_dir, loss, dtype, temperature):
    """Fails before the wiring: ``loss.fused_linear`` and ``model_output`` did not exist and
    training always made the [T, V] logits."""
    job = {"layout": {}, "dtype": dtype, "loss": LOSSES[loss], "temperature": temperature}
    (report,) = _worker(0, str(tiny_moe_dir), [job])
    _compare(report, dtype)


def test_fused_linear_training_equals_logits_path_tp2_sp_and_pp2(tiny_moe_dir):
    """Vocab-parallel (TP2 + sequence parallel): each TP rank multiplies by its vocab shard;
    the stats combine over the group and the hidden-state gradient's reduce-scatter sums the
    shards' partial gradients, as the output layer's own backward does. PP2: Megatron's
    schedule hands the last stage's loss the hidden states; the first stage is unchanged."""
    from megagrpo.parallel.launch import launch

    jobs = [
        {"layout": layout, "dtype": "float32", "loss": LOSSES[loss], "temperature": 0.6}
        for layout, loss in (
            ({"tp": 2, "sequence_parallel": True}, "grpo_kl_entropy"),
            ({"pp": 2}, "gspo"),
        )
    ]
    ranks = launch(_worker, 2, str(tiny_moe_dir), jobs)
    for per_rank in ranks:
        for report in per_rank:
            _compare(report, "float32")
