#!/usr/bin/env python
"""Training peak memory with the fused-linear loss (``loss.fused_linear``) vs the logits path.

One training pass (forward + fused GRPO loss + backward over the micro-batches, through the
trainer's own ``model_output`` / ``micro_batch_loss``) of a random tiny Qwen3-MoE with a large
vocabulary on CPU, one process, measured as the peak of tensor bytes torch's allocator held
during the pass (megagrpo.profiling.allocator_peak_bytes: independent of other jobs).

Usage: python tools/bench_train_memory.py [--vocab 65536 --seqs 8 --seq-len 256] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--seqs", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="vocab 32768, 4 x 256 tokens")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _model(out: Path, vocab: int) -> Path:
    from transformers import AutoModelForCausalLM

    from megagrpo.testing import build_tiny_tokenizer, tiny_config

    build_tiny_tokenizer(out)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("moe", vocab_size=vocab))
    model.save_pretrained(out, safe_serialization=True)
    return out


def _pass(policy, mbs, fused: bool) -> int:
    from megagrpo.algo.config import LossConfig
    from megagrpo.profiling import allocator_peak_bytes
    from megagrpo.trainer.loss_head import micro_batch_loss, model_output

    cfg = LossConfig(variant="grpo", backend="torch", fused_linear=fused)

    def run():
        with model_output(policy, cfg) as weight:
            policy.forward_backward(
                mbs,
                lambda out, i: (
                    micro_batch_loss(out, weight, mbs[i], None, None, cfg, None, 1.0)[0],
                    None,
                ),
            )

    run()  # warm-up: lazily built state out of the measured pass
    for p in policy.lora_parameters():
        p.grad = None
    return allocator_peak_bytes(run)[1]


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.quick:
        a.vocab, a.seqs, a.seq_len = 32768, 4, 256
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.trainer.batch import Sample, micro_batches

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = _model(Path(tmp) / "m", a.vocab)
        groups = init_parallel(ParallelConfig())
        try:
            lora = LoraConfig(rank=8, alpha=16.0, targets=["linear_qkv", "linear_proj"])
            policy = build_policy(ModelConfig(hf_path=str(hf_dir), lora=lora), groups)
            g = torch.Generator().manual_seed(0)
            samples = [
                Sample(torch.randint(0, a.vocab, (a.seq_len,), generator=g).tolist(), 8, 1.0, [], i)
                for i in range(a.seqs)
            ]
            mbs = list(micro_batches(samples, a.seqs, 0))
            peaks = {
                name: _pass(policy, mbs, fused)
                for name, fused in (("logits", False), ("fused_linear", True))
            }
        finally:
            destroy_parallel()
    tokens = a.seqs * a.seq_len
    res = {
        "vocab": a.vocab,
        "tokens": tokens,
        "hidden": 64,
        "logits_bytes_fp32": tokens * a.vocab * 4,
        "peak_bytes_logits_path": peaks["logits"],
        "peak_bytes_fused_linear": peaks["fused_linear"],
        "ratio": peaks["logits"] / max(peaks["fused_linear"], 1),
        "memory_method": "torch allocator bytes (profiler allocation events), one pass",
    }
    if a.json:
        print(json.dumps(res))
    else:
        print(f"training pass, V={a.vocab}, {tokens} tokens, fp32 tiny MoE (H=64), CPU:")
        print(f"  logits path   peak {peaks['logits'] / 2**20:9.1f} MiB")
        print(f"  fused linear  peak {peaks['fused_linear'] / 2**20:9.1f} MiB")
        logits_mib = res["logits_bytes_fp32"] / 2**20
        print(f"  ratio {res['ratio']:.1f}x  ([T, V] fp32 logits alone: {logits_mib:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
