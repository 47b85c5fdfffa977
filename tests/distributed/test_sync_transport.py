"""Weight-sync transports (``trainer.sync_transport``) on 2 and 4 gloo ranks, real MegatronPolicy.

Every transport must hand out the same merged HF tensors: ``broadcast`` and ``sliced`` (with
every rank needing everything) bit for bit equal to today's zero-fill + all-reduce, on every
rank; ``sliced`` with partial needs (row blocks per rank, two boxes for q_proj, whole experts
on one rank only, nothing for some tensors) yields exactly the needed regions, zero elsewhere,
and skips the tensors a rank needs none of. Bytes: broadcast receives half of what the ring
all-reduce moves (summed over ranks), sliced less again. Layouts: TP2 (+SP), EP2, TP2xEP2.
The LoRA factors are random (B != 0), so the merged values differ from the base.
"""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "tp2": (dict(tp=2, sequence_parallel=True), 2),
    "ep2": (dict(ep=2), 2),
    "tp2ep2": (dict(tp=2, ep=2, sequence_parallel=True), 4),
}


def partial_needs(rank: int, world: int):
    """A rank-dependent RegionFn exercising every case of the sliced exchange."""

    def needs(name: str, shape: tuple[int, ...]):
        m = re.search(r"experts\.(\d+)\.", name)
        if m:  # whole experts, each on one rank (as vLLM's expert parallelism holds them)
            return [()] if int(m.group(1)) % world == rank else []
        if "lm_head" in name and rank == 0:
            return []
        if len(shape) == 1:
            return None
        n = shape[0]
        lo, hi = rank * n // world, (rank + 1) * n // world
        if "q_proj" in name:  # two boxes: the first half rows, the second half's left columns
            mid = (lo + hi) // 2
            return [(slice(lo, mid),), (slice(mid, hi), slice(0, shape[1] // 2))]
        return [(slice(lo, hi),)]

    return needs


def train_lora(policy, steps: int = 2, lr: float = 0.5) -> None:
    """A few SGD steps on a fixed input: LoRA B != 0, every replica of a factor equal (the
    gradients are synced as in training)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (2, 8), generator=gen)
    params = policy.lora_parameters()
    for _ in range(steps):
        logits = policy.forward_logits(ids)
        (logits.float().pow(2).mean()).backward()
        policy.finish_grad_sync()
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
                p.grad = None


def _worker(rank: int, hf_dir: str, layouts: list[dict]) -> list[dict]:
    """Every transport's export under each layout in turn (one launch of the ranks)."""
    import faulthandler
    import sys

    import torch.distributed as dist

    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    faulthandler.dump_traceback_later(300, exit=True, file=sys.stderr)  # a hang fails
    torch.set_num_threads(1)
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    results = []
    for i, layout in enumerate(layouts):
        g = init_parallel(ParallelConfig(**layout))
        try:
            lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
            policy = build_policy(ModelConfig(hf_path=hf_dir, lora=lora), g)
            train_lora(policy)
            needs = partial_needs(dist.get_rank(), dist.get_world_size())
            out: dict = {}
            runs = {
                "allreduce": ("allreduce", None),
                "broadcast": ("broadcast", None),
                "sliced": ("sliced", None),
                "sliced_part": ("sliced", needs),
            }
            for key, (transport, fn) in runs.items():
                tensors = {
                    n: t.clone()
                    for bucket in policy.export_hf_weights(transport=transport, needs=fn)
                    for n, t in bucket
                }
                out[key] = {"tensors": tensors, "received": policy.export_counter.received}
            results.append(out)
        finally:
            destroy_parallel(keep_process_group=i < len(layouts) - 1)
    faulthandler.cancel_dump_traceback_later()
    return results


@pytest.fixture(scope="module")
def results(tiny_moe_dir):
    from megagrpo.parallel.launch import launch

    out = {}
    for world in (2, 4):
        names = [n for n, (_, w) in LAYOUTS.items() if w == world]
        ranks = launch(_worker, world, str(tiny_moe_dir), [LAYOUTS[n][0] for n in names])
        out.update({n: [r[i] for r in ranks] for i, n in enumerate(names)})
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_transport_yields_the_same_tensors(results, layout):
    ranks = results[layout]
    ref = ranks[0]["allreduce"]["tensors"]
    assert len(ref) > 20 and any("experts" in n for n in ref)
    for r, out in enumerate(ranks):
        for transport in ("allreduce", "broadcast", "sliced"):
            got = out[transport]["tensors"]
            assert got.keys() == ref.keys(), (r, transport)
            for name, t in ref.items():
                assert torch.equal(got[name], t), (r, transport, name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sliced_yields_exactly_the_needed_regions(results, layout):
    from megagrpo.model.sync_transport import bounds

    ranks = results[layout]
    world = len(ranks)
    ref = ranks[0]["allreduce"]["tensors"]
    for r, out in enumerate(ranks):
        needs = partial_needs(r, world)
        got = out["sliced_part"]["tensors"]
        for name, full in ref.items():
            regions = needs(name, tuple(full.shape))
            if regions == []:
                assert name not in got, (r, name)
                continue
            mask = torch.zeros(full.shape, dtype=torch.bool)
            for region in regions or [()]:
                mask[tuple(slice(s, e) for s, e in bounds(region, tuple(full.shape)))] = True
            t = got[name]
            assert torch.equal(t[mask], full[mask]), (r, name)
            assert not t[~mask].any(), (r, name)  # zero outside the regions


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bytes_per_transport(results, layout):
    ranks = results[layout]
    total = {k: sum(out[k]["received"] for out in ranks) for k in ranks[0]}
    assert total["allreduce"] > 0
    # ring all-reduce: 2 (n-1)/n of each tensor per rank; broadcast: (n-1)/n on average
    assert total["broadcast"] == pytest.approx(total["allreduce"] / 2, rel=1e-3)
    assert total["sliced"] == total["broadcast"]  # everyone needs everything: same bytes
    assert total["sliced_part"] < total["broadcast"]
