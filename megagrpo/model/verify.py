"""The parallel Megatron model against transformers' own model (`megagrpo verify-model`).

Launches the layout's gloo ranks itself (or runs in-process for one rank), loads the HF
weights into the sharded model, and compares logits on fixed inputs with
``AutoModelForCausalLM`` in fp32; checks that zero-initialised LoRA leaves the logits
unchanged and that HF → Megatron → HF round-trips bitwise. ``--meta`` builds one rank of a
full-size layout on the meta device instead and reports parameter counts and shard sizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


def gather_vocab(logits: torch.Tensor, groups) -> torch.Tensor:
    """[B, T, V/TP] local logits → [B, T, V] on every TP rank."""
    import torch.distributed as dist

    if groups.tp_size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


def _loss_weights(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def parity_worker(rank: int, job: dict) -> dict | list | None:
    """One rank of a verification job (see :func:`run_layout`). Returns rank 0's report.

    ``job["jobs"]``: several jobs run one after another in the same processes (Megatron's
    parallel state is rebuilt between them); rank 0 then returns the list of reports.
    """
    if "jobs" in job:
        reports = [
            _one_job(rank, j, keep=i < len(job["jobs"]) - 1) for i, j in enumerate(job["jobs"])
        ]
        return reports if rank == 0 else None
    return _one_job(rank, job, keep=False)


def _one_job(rank: int, job: dict, keep: bool) -> dict | None:
    from safetensors.torch import load_file

    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.model.weights import safetensors_files
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    pcfg = ParallelConfig(**job["layout"])
    groups = init_parallel(pcfg)
    try:
        lora = LoraConfig(**job.get("lora", {"rank": 4, "alpha": 8.0}))
        mcfg = ModelConfig(hf_path=job["hf_dir"], lora=lora, spec=job.get("spec", "auto"))
        policy = build_policy(mcfg, groups)
        ids = job["input_ids"]
        report: dict[str, Any] = {"world_size": groups.world_size, "layout": job["layout"]}
        with torch.no_grad():
            logits = full_logits(policy, ids, groups)
            scales = {k: a.scaling for k, a in policy.adapters.items()}
            for a in policy.adapters.values():
                a.scaling = 0.0  # adapters off: the base model
            base = full_logits(policy, ids, groups)
            for k, a in policy.adapters.items():
                a.scaling = scales[k]
        report["logits"] = logits.cpu()  # on GPU: compared with transformers' CPU logits
        report["lora_zero_init_max_diff"] = (logits - base).abs().max().item()
        orig = {}
        for f in safetensors_files(job["hf_dir"]):
            orig.update(load_file(str(f)))
        if policy.arch.tie_word_embeddings:
            orig.pop("lm_head.weight", None)
        seen, equal = 0, True
        for bucket in policy.export_hf_weights(merge_lora=True, bucket_bytes=1 << 20):
            for name, t in bucket:
                seen += 1
                equal &= name in orig and torch.equal(t.cpu(), orig[name])
        report["roundtrip_bitwise"] = bool(equal and seen == len(orig))
        if job.get("train_steps"):
            report.update(_train(policy, groups, ids, job))
        return report if rank == 0 else None
    finally:
        destroy_parallel(keep_process_group=keep)


@dataclass
class _Rows:
    """``ids`` as one micro-batch of the pipeline schedule."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor


def full_logits(policy, ids: torch.Tensor, groups) -> torch.Tensor:
    """Logits ``[B, T, V]`` (vocab gathered over TP) on every rank; with pp > 1 through
    Megatron's schedule (forward only), computed on the last stage and broadcast."""
    if groups.pp_size == 1:
        return gather_vocab(policy.forward_logits(ids), groups)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)

    def keep(logits: torch.Tensor, i: int):
        return None, gather_vocab(logits, groups).detach().cpu()

    (out,) = policy.forward_backward([_Rows(ids, pos)], keep, forward_only=True)
    return out


def _train(policy, groups, ids, job) -> dict:
    """SGD steps on a fixed linear loss of the logits; gradients gathered per step."""
    from megagrpo.model.peft_export import gather_lora

    b, t = ids.shape
    v = policy.arch.vocab_size
    w = _loss_weights((b, t, v), job.get("loss_seed", 7))
    n = v // groups.tp_size
    w_local = w[..., groups.tp_rank * n : (groups.tp_rank + 1) * n].to(groups.device)
    opt = torch.optim.SGD(policy.lora_parameters(), lr=job.get("lr", 0.5))
    grads = []
    for _ in range(job["train_steps"]):
        opt.zero_grad()
        loss = (policy.forward_logits(ids) * w_local).sum() / (b * t)
        loss.backward()
        policy.finish_grad_sync()
        grads.append(
            {
                k: (a.clone().cpu(), bb.clone().cpu())
                for k, (a, bb) in gather_lora(policy, use_grad=True).items()
            }
        )
        opt.step()
    out: dict[str, Any] = {"grads": grads}
    with torch.no_grad():
        out["trained_logits"] = gather_vocab(policy.forward_logits(ids), groups).cpu()
    if job.get("adapter_dir"):
        policy.export_peft_adapter(job["adapter_dir"])
        out["adapter_dir"] = job["adapter_dir"]
    if job.get("merged_dir"):
        out["merged"] = {k: t.cpu() for bucket in policy.export_hf_weights() for k, t in bucket}
    return out


def run_layout(hf_dir: str, layout: dict, world_size: int, input_ids: torch.Tensor, **job) -> dict:
    """Run :func:`parity_worker` on ``world_size`` ranks (in-process when 1); rank 0's report."""
    from megagrpo.parallel.launch import launch

    job = dict(job, hf_dir=str(hf_dir), layout=layout, input_ids=input_ids)
    report = parity_worker(0, job) if world_size == 1 else launch(parity_worker, world_size, job)[0]
    assert isinstance(report, dict), "rank 0 returns its report"
    return report


def run_layouts(jobs: list[dict], world_size: int) -> list[dict]:
    """Several verification jobs (each: hf_dir, layout, input_ids, ...) in one launch."""
    from megagrpo.parallel.launch import launch

    jobs = [dict(j, hf_dir=str(j["hf_dir"])) for j in jobs]
    return launch(parity_worker, world_size, {"jobs": jobs})[0]


def hf_reference_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' own fp32 logits [B, T, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def fixed_inputs(vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
