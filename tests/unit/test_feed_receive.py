"""The engine rank's side of the owner-fed adapter (placement separate,
:func:`megagrpo.placement.feed.receive_adapter`, audit 3 P1): under strict device mode
(emulated GPU) the buckets arrive on the device, and what the engine keeps is host copies of
the attention factors and of its own experts' only, no view of a device bucket, equal to the
factors the owners sent. The trainer side (buckets summed onto their owners) is
tests/distributed/test_adapter_feed.py."""

from __future__ import annotations

import torch

from megagrpo.parallel.strict import on_host, strict_devices
from megagrpo.placement.bridge import FEED, thread_pair
from megagrpo.placement.feed import FeedBucket, receive_adapter
from megagrpo.rollout.lora import expert_of

R, EXPERTS = 2, 4
SHAPES = {"model.layers.0.self_attn.q_proj.weight": (8, 6)} | {
    f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": (5, 6) if p != "down" else (6, 5)
    for e in range(EXPERTS)
    for p in ("gate", "up", "down")
}


def _feed(dev: torch.device, experts: tuple[int, int] | None):
    """Factors per unit, sent in buckets of 3 units from owners 0 and 1 in turn; the
    engine's adapter and bytes received."""
    gen = torch.Generator().manual_seed(3)
    factors = {
        n: (torch.randn(R, i, generator=gen), torch.randn(o, R, generator=gen))
        for n, (o, i) in SHAPES.items()
    }
    names = list(SHAPES)
    pairs = {0: thread_pair(), 1: thread_pair()}
    manifest = []
    for k in range(0, len(names), 3):
        units = tuple((n, SHAPES[n]) for n in names[k : k + 3])
        owner = (k // 3) % 2
        flat = torch.cat([t.reshape(-1) for n, _ in units for t in factors[n]])
        pairs[owner][0].send_tensor(FEED, flat.to(dev, torch.bfloat16))  # a device bucket
        manifest.append(FeedBucket(owner, units, "bfloat16"))
    adapter, received = receive_adapter(
        manifest, lambda o: pairs[o][1], R, 4.0, EXPERTS, experts=experts
    )
    return factors, manifest, adapter, received


def test_the_engine_keeps_host_copies_of_its_own_experts():
    with strict_devices(device="cpu") as dev:
        factors, manifest, adapter, received = _feed(dev, (2, 4))
        want = {
            n.removesuffix(".weight") for n in SHAPES if (e := expert_of(n)) is None or 2 <= e < 4
        }
        assert set(adapter.a) == want and set(adapter.b) == want
        assert len(want) == 1 + 2 * 3  # attention + experts 2 and 3
        for module in want:
            for t, ref in zip((adapter.a[module], adapter.b[module]), factors[module + ".weight"]):
                assert on_host(t) and t.dtype == torch.bfloat16
                assert t.untyped_storage().nbytes() == t.numel() * 2  # no view of a bucket
                assert torch.equal(t, ref.to(torch.bfloat16))
        assert received == sum(b.numel(R) for b in manifest) * 2  # every bucket arrived


def test_without_expert_parallelism_every_expert_stays():
    with strict_devices(device="cpu") as dev:
        _, _, adapter, _ = _feed(dev, None)
        assert set(adapter.a) == {n.removesuffix(".weight") for n in SHAPES}
        assert all(on_host(t) for t in (*adapter.a.values(), *adapter.b.values()))
