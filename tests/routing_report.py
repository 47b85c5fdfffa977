"""Test helper: how an engine's returned MoE routing fits the trainer's routers (used by the
routing replay tests on CPU and on GPU; it builds micro-batches the trainer's way, so it lives
beside the tests rather than in megagrpo.model)."""

from __future__ import annotations

from typing import Any

import torch
from routing_verify import target_logprobs


def routing_report(policy: Any, groups: list, micro_batch_size: int = 8) -> dict[str, float]:
    """How an engine's returned routing fits the trainer's routers on the same weights:
    ``agreement`` (own top-k set == engine's, over fed token x MoE layer), and the max
    |trainer - engine| sampled-token log-prob with the engine's routing replayed
    (``max_diff_r3``) and with the own routing (``max_diff_off``). One process (no TP)."""
    from megagrpo.model.routing import Routing
    from megagrpo.trainer.batch import build_samples, micro_batches

    adv = torch.zeros(len(groups), max(g.size for g in groups))
    agree = total = 0.0
    diffs = {"r3": 0.0, "off": 0.0}
    dev = policy.groups.device
    with policy.scoring():
        for mb in micro_batches(build_samples(groups, adv), micro_batch_size):
            mb = mb.to(dev)
            if mb.routing is None or mb.routing_valid is None:
                raise ValueError("the groups carry no routing")
            m = mb.mask.bool()
            for mode, action in (("r3", "replay"), ("off", "measure")):
                routing = Routing(mb.routing, mb.routing_valid, action, mode == "off")
                logits = policy.forward_logits(mb.input_ids, mb.position_ids, routing=routing)
                logp = target_logprobs(logits.float(), mb.target_ids)
                diff = (logp - mb.rollout_logprobs.double())[m].abs().max().item()
                diffs[mode] = max(diffs[mode], diff)
                agree += routing.agree
                total += routing.total
    return {
        "agreement": agree / max(total, 1.0),
        "max_diff_r3": diffs["r3"],
        "max_diff_off": diffs["off"],
    }
