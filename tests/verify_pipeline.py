"""One GRPO training pass through ``MegatronPolicy.forward_backward`` under a layout, for the
pipeline (PP) and packing parity checks (tests/distributed/test_pipeline.py, test_packing.py).

:func:`grpo_pass_worker` runs, per step: the no-grad scoring pass (old log-probs, forward
only, kept on the last stage), the training pass (the fused GRPO loss of every micro-batch,
weighted by its share of the batch's loss tokens, as the trainer does), the LoRA gradient
sync, then an SGD step; it returns the per-micro-batch metrics (broadcast to every stage),
the full LoRA gradients of every step (gathered over all ranks) and the old log-probs.
"""

from __future__ import annotations

from typing import Any

import torch


def grpo_pass_worker(rank: int, job: dict) -> dict | list[dict]:
    """One rank of a parity job: ``job`` = ``hf_dir``, ``layout`` (ParallelConfig kwargs),
    ``mbs`` (micro-batches: the trainer's ``MicroBatch`` or packed ones), optional ``lora``
    (LoraConfig kwargs), ``model`` (ModelConfig kwargs, e.g. ``recompute``), ``loss``
    (LossConfig kwargs), ``steps``, ``lr``. ``job["jobs"]``: several jobs one after another
    in the same processes (a list of reports)."""
    if "jobs" in job:
        return [_one_job(j, keep=i < len(job["jobs"]) - 1) for i, j in enumerate(job["jobs"])]
    return _one_job(job, keep=False)


def _one_job(job: dict, keep: bool) -> dict:
    from megagrpo.algo.config import LossConfig
    from megagrpo.kernels import fused_policy_loss, token_stats
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.peft_export import gather_lora
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    groups = init_parallel(ParallelConfig(**job["layout"]))
    try:
        lora = LoraConfig(**job.get("lora", {"rank": 4, "alpha": 8.0}))
        mcfg = ModelConfig(hf_path=job["hf_dir"], lora=lora, **job.get("model", {}))
        policy = build_policy(mcfg, groups)
        cfg = LossConfig(**job.get("loss", {"variant": "dapo"}))
        mbs = [mb.to(groups.device) for mb in job["mbs"]]
        agg = cfg.resolved_loss_agg()
        key = {"token_mean": "num_tokens", "seq_mean_token_mean": "num_nonempty"}.get(
            agg, "num_seqs"
        )
        total = float(sum(getattr(mb, key) for mb in mbs))

        def weight(mb) -> float:  # the trainer's microbatch_weight
            return getattr(mb, key) / total

        tp = groups.tp if groups.tp_size > 1 else None
        opt = torch.optim.SGD(policy.lora_parameters(), lr=job.get("lr", 0.05))
        report: dict[str, Any] = {"metrics": [], "grads": [], "old": []}

        def seq_ids(mb):
            return getattr(mb, "seq_ids", None)

        def logp_fn(logits, i):
            logp, *_ = token_stats(logits, mbs[i].target_ids, tp_group=tp, backend="torch")
            return None, logp.reshape(mbs[i].target_ids.shape).float() * mbs[i].mask

        for _ in range(job.get("steps", 2)):
            with policy.scoring():
                old = policy.forward_backward(mbs, logp_fn, forward_only=True, broadcast=False)

            def loss_fn(logits, i, old=old):
                mb = mbs[i]
                loss, m = fused_policy_loss(
                    logits,
                    mb.target_ids,
                    old[i],
                    mb.advantages,
                    mb.mask,
                    cfg,
                    tp_group=tp,
                    seq_ids=seq_ids(mb),
                )
                w = weight(mb)
                return loss * w, {k: w * float(v) for k, v in m.items()}

            opt.zero_grad(set_to_none=True)
            report["metrics"].append(policy.forward_backward(mbs, loss_fn))
            policy.finish_grad_sync()
            report["grads"].append(gather_lora(policy, use_grad=True))
            report["old"].append([o.detach().cpu() if o is not None else None for o in old])
            opt.step()
        report["is_last_stage"] = groups.is_last_stage
        report["pp_rank"] = groups.pp_rank
        return report
    finally:
        destroy_parallel(keep_process_group=keep)


def run_grpo_passes(jobs: list[dict], world_size: int) -> list[list[dict]]:
    """Several jobs (each: ``hf_dir``, ``layout``, ``mbs``, ...) on ``world_size`` gloo ranks in
    one launch (in-process for 1); per job, every rank's report in rank order."""
    from megagrpo.parallel.launch import launch

    jobs = [dict(j, hf_dir=str(j["hf_dir"])) for j in jobs]
    per_rank = launch(grpo_pass_worker, world_size, {"jobs": jobs})
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(jobs))]
