"""Shared prefix against the rows, on the same batch, through the trainer's own code
(``build_micro_batches``, ``micro_batch_loss`` / ``micro_batch_logprobs``, Megatron's pipeline
schedule): per-token log-probs, loss, every LoRA gradient, and (one stage) the logits at the
completion positions. Used by tests/unit/test_shared_prefix_model.py (one process) and
tests/distributed/test_shared_prefix_layouts.py (gloo ranks, several layouts per launch).

A job: ``hf_dir``, ``layout`` (ParallelConfig kwargs), ``dtype`` and ``checks``: a list of
dicts, each measured on the same policy with both paths: ``groups`` (``make_groups``
kwargs), ``fused_linear``, ``loss`` (LossConfig kwargs), ``routing`` (off | r3), ``old``
(rollout: the engine's log-probs are the behaviour ones, so the ratio departs from 1 |
recompute: the scoring forward's), ``pack_tokens``, ``route`` (thd: the THD route with the
local spec's kernel, the default | mask: megatron's attention under the segments' mask |
ref: THD with the dense :func:`reference_attend` | te: TE's kernel, ``spec: te``), ``logits``,
``env`` (environment variables for both paths of the check: TE's backend switches).
Both paths run from the same weights: one SGD step of the rows first, so the LoRA B factors
(zero at start) are not and every gradient is live.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def make_groups(
    vocab: int,
    n: int = 3,
    g: int = 4,
    seed: int = 0,
    prompt: tuple[int, int] = (5, 12),
    completion: tuple[int, int] = (0, 14),
    routing: tuple[int, int, int] | None = None,
    rollout_logprobs: bool = True,
):
    """``n`` groups of ``g`` completions over token ids ``[0, vocab)`` (an empty completion
    included), with ``routing = (layers, experts, top_k)`` engine routing whose prompt rows
    agree within a group, and engine log-probs when ``rollout_logprobs`` (partial rollouts:
    tokens of older policies)."""
    from megagrpo.types import Group, Problem

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(prompt[0], prompt[1], (1,), generator=gen))
        prompt_ids = torch.randint(0, vocab, (p,), generator=gen).tolist()
        lens = torch.randint(completion[0] + 1, completion[1], (g,), generator=gen).tolist()
        if i == 0:
            lens[-1] = 0  # an empty completion
        toks = [torch.randint(0, vocab, (n_,), generator=gen).tolist() for n_ in lens]
        lps = [(-torch.rand(n_, generator=gen) * 3).tolist() for n_ in lens]
        route = []
        if routing is not None:
            layers, experts, k = routing
            shared = _route(p, layers, experts, k, gen)
            for n_ in lens:
                own = _route(max(n_ - 1, 0), layers, experts, k, gen)
                route.append(torch.cat([shared, own])[: p + n_ - 1].to(torch.int16))
        out.append(
            Group(
                problem=Problem(id=f"p{i}", messages=[], answer=["a"]),
                completions=["x"] * g,
                token_ids=toks,
                logprobs=lps if rollout_logprobs else [],
                rewards=torch.randn(g, generator=gen).tolist(),
                prompt_ids=prompt_ids,
                finish_reasons=["stop"] * g,
                routing=route,
            )
        )
    return out


def _route(n: int, layers: int, experts: int, k: int, gen) -> torch.Tensor:
    scores = torch.rand(n, layers, experts, generator=gen)
    return scores.topk(k, dim=-1).indices


def parity_worker(rank: int, job: dict) -> list[dict]:
    """Every job of ``job["jobs"]`` in these processes, one after another."""
    jobs = job["jobs"]
    return [_one_job(j, keep=i < len(jobs) - 1) for i, j in enumerate(jobs)]


def run_parity(jobs: list[dict], world_size: int) -> list[list[dict]]:
    """``jobs`` on ``world_size`` gloo ranks in one launch; per job, every rank's report."""
    from megagrpo.parallel.launch import launch

    jobs = [dict(j, hf_dir=str(j["hf_dir"])) for j in jobs]
    per_rank = launch(parity_worker, world_size, {"jobs": jobs})
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(jobs))]


def _one_job(job: dict, keep: bool) -> dict:
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.model.shared_prefix import (
        install_thd_attention,
        reference_attend,
        torch_attend,
    )
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    pgs = init_parallel(ParallelConfig(**job["layout"]))
    try:
        lora = LoraConfig(rank=4, alpha=8.0, targets=job.get("targets", LoraConfig().targets))
        mcfg = ModelConfig(
            hf_path=job["hf_dir"],
            lora=lora,
            dtype=job.get("dtype", "float32"),
            spec=job.get("spec", "auto"),
        )
        policy = build_policy(mcfg, pgs)
        if job.get("route") == "thd":
            assert install_thd_attention(policy.model, reference_attend) > 0
            policy.prefix_route = "thd"
        report: dict[str, Any] = {"is_last_stage": pgs.is_last_stage, "checks": []}
        for i, check in enumerate(job["checks"]):
            route = check.get("route", "thd")
            if route in ("thd", "ref"):  # the local spec's kernel, or the dense stand-in
                attend = reference_attend if route == "ref" else torch_attend
                assert install_thd_attention(policy.model, attend) > 0
            policy.prefix_route = "mask" if route == "mask" else "thd"  # te: TE's own kernel
            groups = make_groups(policy.arch.vocab_size, **check.get("groups", {}))
            with _environ(check.get("env", {})):
                paths = {s: _Path(policy, pgs, check, groups, s) for s in (False, True)}
                if i == 0:
                    paths[False].sgd_step()  # both paths from the same non-zero LoRA B
                res = {s: path.measure(check.get("logits", False)) for s, path in paths.items()}
            report["checks"].append(res)
        return report
    finally:
        destroy_parallel(keep_process_group=keep)


class _Path:
    """The micro-batches of one path (rows or shared) and what it measures."""

    def __init__(self, policy, pgs, job: dict, groups: list, shared: bool):
        from megagrpo.algo.advantages import group_advantages
        from megagrpo.algo.config import LossConfig
        from megagrpo.trainer.optimize import build_micro_batches, local_share

        self.policy, self.pgs, self.job = policy, pgs, job
        self.cfg = LossConfig(**job.get("loss", {"variant": "dapo"}))
        self.cfg.fused_linear = job.get("fused_linear", self.cfg.fused_linear)
        self.old_source = job.get("old", "rollout")
        rewards = torch.tensor([g.rewards for g in groups])
        adv = list(group_advantages(rewards))
        mine, my_adv = local_share(groups, adv, pgs.dp_rank, pgs.dp_size)
        pad_to = pgs.tp_size if pgs.sequence_parallel else 1
        self.mbs = build_micro_batches(
            mine, my_adv, 3, 0, pgs.device, pad_to, job.get("pack_tokens", 0), shared_prefix=shared
        )
        self.tp = pgs.tp if pgs.tp_size > 1 else None
        self.plan = None
        if job.get("routing") == "r3":
            from megagrpo.model.routing import step_plan

            engine = [(mb.routing, mb.routing_valid) for mb in self.mbs]
            self.plan = step_plan("r3", engine, routed=True, old_source="recompute")

    def _routing(self):
        return None if self.plan is None else self.plan.policy

    def logprobs(self) -> list:
        from megagrpo.trainer.loss_head import micro_batch_logprobs, model_output

        mbs = self.mbs
        with self.policy.scoring(), model_output(self.policy, self.cfg) as weight:

            def fn(out, i):
                return None, micro_batch_logprobs(out, weight, mbs[i], self.cfg, self.tp, 1.0)

            return self.policy.forward_backward(
                mbs, fn, forward_only=True, broadcast=False, routing=self._routing()
            )

    def backward(self, old: list) -> float:
        from megagrpo.trainer.batch import BatchTotals, microbatch_weight
        from megagrpo.trainer.loss_head import micro_batch_loss, model_output

        agg = self.cfg.resolved_loss_agg()
        totals = BatchTotals(*self._totals())
        sums = []
        with model_output(self.policy, self.cfg) as weight:

            def fn(out, i):
                mb = self.mbs[i]
                loss, _ = micro_batch_loss(out, weight, mb, old[i], None, self.cfg, self.tp, 1.0)
                w = microbatch_weight(mb, agg, totals)
                return loss * w, float(loss) * w

            sums = self.policy.forward_backward(self.mbs, fn, routing=self._routing())
        return float(sum(sums))

    def behaviour(self, scored: list) -> list:
        """The old log-probs the loss takes: the engine's, or the scoring forward's (only on
        the last pipeline stage; the others never read them)."""
        if self.old_source == "rollout":
            return [mb.rollout_logprobs for mb in self.mbs]
        return [mb.mask if o is None else o.detach() for mb, o in zip(self.mbs, scored)]

    def _totals(self) -> tuple[float, float, float]:
        import torch.distributed as dist

        t = torch.tensor(
            [
                sum(mb.num_seqs for mb in self.mbs),
                sum(mb.num_nonempty for mb in self.mbs),
                sum(mb.num_tokens for mb in self.mbs),
            ],
            dtype=torch.float64,
        )
        if self.pgs.dp_size > 1:
            dist.all_reduce(t, group=self.pgs.dp)
        return tuple((t / self.pgs.dp_size).tolist())

    def sgd_step(self) -> None:
        old = self.behaviour(self.logprobs())
        opt = torch.optim.SGD(self.policy.lora_parameters(), lr=0.5)
        opt.zero_grad(set_to_none=True)
        self.backward(old)
        self.policy.finish_grad_sync()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def measure(self, logits: bool) -> dict:
        from megagrpo.model.peft_export import gather_lora

        old = self.logprobs()
        self.policy.zero_grad(set_to_none=True)
        loss = self.backward(self.behaviour(old))
        self.policy.finish_grad_sync()
        out = {
            "logprobs": per_sample(self.mbs, old),
            "loss": loss,
            "grads": gather_lora(self.policy, use_grad=True),
            "micro_batches": len(self.mbs),
            "row_tokens": sum(int(mb.input_ids.numel()) for mb in self.mbs),
        }
        if logits:
            out["logits"] = self.completion_logits()
        return out

    def completion_logits(self) -> dict[int, torch.Tensor]:
        """Per sample, its logits at the positions predicting its completion tokens (one
        stage, TP 1)."""
        from megagrpo.trainer.loss_head import loss_rows

        got = []
        with self.policy.scoring():
            for i, mb in enumerate(self.mbs):
                r = None if self.plan is None else self.plan.policy(i)
                out = self.policy.forward_logits(
                    mb.input_ids,
                    mb.position_ids,
                    cu_seqlens=mb.cu_seqlens,
                    routing=r,
                    segments=mb.segments,
                )
                got.append(loss_rows(out, mb).float())
        return per_sample(self.mbs, got)


def per_sample(mbs: list, outs: list) -> dict[int, torch.Tensor]:
    """``{sample index: its values [n_completion_tokens, ...]}`` from per-micro-batch tensors
    laid out like the loss tensors (``MicroBatch.spans``); nothing off the last stage."""
    res: dict[int, torch.Tensor] = {}
    for mb, out in zip(mbs, outs):
        if out is None:
            continue
        for index, (row, lo, hi) in zip(mb.indices, mb.spans or []):
            res[index] = out[row, lo:hi].detach().cpu()
    return res


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` set inside the block (a check's ``env``: e.g. TE's ``NVTE_FLASH_ATTN`` /
    ``NVTE_FUSED_ATTN`` to force one attention backend), TE's cached backend choice dropped
    on entry and exit (TE 2.11 ``dot_product_attention.py`` ``_attention_backends``: it
    re-reads the variables only when it selects again)."""
    import os
    import sys

    def reselect() -> None:
        mod = sys.modules.get(
            "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
        )
        if mod is not None:
            mod._attention_backends["backend_selection_requires_update"] = True

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    reselect()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reselect()


def rel_diffs(rows: dict, shared: dict) -> dict[str, float]:
    """Largest relative difference of each measured quantity, shared against rows: per-token
    log-probs and logits over every completion (relative to the largest value), the loss,
    and every LoRA gradient tensor (each relative to its own largest entry; ``grads_norm``:
    the norm of all gradient differences over the norm of all gradients)."""

    def over(a: dict, b: dict) -> float:
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        scale = max((float(t.abs().max()) for t in b.values() if t.numel()), default=1.0)
        diff = max((float((a[k] - b[k]).abs().max()) for k in a if a[k].numel()), default=0.0)
        return diff / max(scale, 1e-30)

    out = {"logprobs": over(shared["logprobs"], rows["logprobs"])}
    if "logits" in rows:
        out["logits"] = over(shared["logits"], rows["logits"])
    out["loss"] = abs(shared["loss"] - rows["loss"]) / max(abs(rows["loss"]), 1e-3)
    grads = []
    for name, pair in rows["grads"].items():
        for want, got in zip(pair, shared["grads"][name]):
            grads.append(float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30))
    out["grads"] = max(grads)
    sq_diff = sq = 0.0
    for name, pair in rows["grads"].items():
        for want, got in zip(pair, shared["grads"][name]):
            sq_diff += float((got - want).double().pow(2).sum())
            sq += float(want.double().pow(2).sum())
    out["grads_norm"] = (sq_diff / max(sq, 1e-300)) ** 0.5
    out["grad_min_scale"] = min(float(t.abs().max()) for p in rows["grads"].values() for t in p)
    return out
