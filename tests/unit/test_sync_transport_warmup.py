"""The sliced transport's first batched P2P exchange on a group is well defined: torch's
``batch_isend_irecv`` docs leave a group's *first* collective undefined when only some of
its ranks take part, and a sliced exchange on ``expert_mp`` involves only the ranks holding
or needing a tensor's pieces. So every sliced export first runs one all-reduce in which
every rank of ``mp`` and ``expert_mp`` takes part (the order is what is checked here; the
exchange itself runs on gloo ranks in tests/distributed/test_sync_transport.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from megagrpo.model import sync_transport


def test_sliced_export_warms_both_groups_up_before_any_p2p(monkeypatch):
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(sync_transport.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(
        sync_transport.dist, "all_reduce", lambda t, group=None: calls.append(("all_reduce", group))
    )
    monkeypatch.setattr(
        sync_transport.dist,
        "batch_isend_irecv",
        lambda ops: calls.append(("p2p", None)) or [],
    )
    groups: Any = SimpleNamespace(mp="mp", expert_mp="expert_mp", device=torch.device("cpu"))
    for transport, want in (
        ("sliced", [("all_reduce", "mp"), ("all_reduce", "expert_mp")]),
        ("broadcast", []),
    ):
        calls.clear()
        out = sync_transport.transported(
            iter([]),
            lambda name: [],
            None,
            groups,
            transport,
            torch.float32,
            None,  # type: ignore[arg-type]
        )
        assert list(out) == []
        assert calls == want, transport
