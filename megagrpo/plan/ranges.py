"""Low / central / high step times from the ranges of the assumptions (`plan-memory`).

Each ranged field of :class:`~megagrpo.plan.scenario.Assumptions` or
:class:`~megagrpo.plan.scenario.Hardware` has the bounds its docstring states and the end that
makes a step faster. :func:`bounds` moves one at a time to each end of its range and combines
the changes of the step time in quadrature (the assumptions are independent; each range read
as a plausible spread, not a hard limit): that is ``low`` / ``high``. ``best`` / ``worst``
put every one at its fast / slow end at once (the corners; a layout whose KV cache cannot
hold the longer completions is infinite there). Whatever ``--assume`` / ``--hw`` / a
measured ``--hw-file`` sets is a point, not a range: a field set away from its default is
held there.

:data:`MEMORY_RANGES`: the memory pools the plan cannot read (CUDA context, NCCL buffers, CUDA
graphs, vLLM's workspace, allocator slack), each an assumption with its range;
``plan-memory`` reports whether a layout still fits with all of them at their high ends.

Not ranged, printed as points: the dynamic-sampling bill (the simulation of the run's levels
file, or the article's histogram when that file is not here: its source is printed) and the
hardware peaks of the data sheet (HBM, bf16, NVLink, InfiniBand, host memory).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from megagrpo.plan.scenario import Assumptions, Hardware


@dataclass(frozen=True)
class Range:
    """Bounds of one assumption; ``fast``: the bound that makes a step faster (low | high);
    ``of``: the dataclass that holds it (assumptions | hardware)."""

    low: float
    high: float
    fast: str
    of: str = "assumptions"

    def end(self, faster: bool) -> float:
        """The bound at the fast end (``faster``) or at the slow end."""
        at_high = (self.fast == "high") == faster
        return self.high if at_high else self.low


RANGES: dict[str, Range] = {
    "moe_lora_decode_speed": Range(0.54, 0.65, "high"),
    "train_mfu": Range(0.15, 0.25, "high"),
    "mean_completion_tokens": Range(800.0, 1400.0, "low"),
    "mean_prompt_tokens": Range(200.0, 500.0, "low"),
    "completion_sigma": Range(0.4, 0.8, "low"),
    "decode_hbm_eff": Range(0.4, 0.6, "high"),
    "decode_mfu": Range(0.3, 0.6, "high"),
    "lora_hbm_eff": Range(0.35, 0.7, "high"),
    "lora_kernel_us": Range(5.0, 10.0, "low"),
    "comm_eff": Range(0.6, 0.8, "high"),
    "prefill_mfu": Range(0.3, 0.5, "high"),
    "partial_chunk_s": Range(0.05, 0.5, "low"),
    "loader_s_per_tensor": Range(1e-4, 5e-4, "low"),
    "loader_gb_s": Range(1.0, 20.0, "high"),
    "host_gb_s": Range(15.0, 40.0, "high", "hardware"),
    "nvlink_latency_us": Range(10.0, 30.0, "low", "hardware"),
    "ib_latency_us": Range(20.0, 80.0, "low", "hardware"),
    "disk_gb_s": Range(1.0, 7.0, "high", "hardware"),
}
"""The ranged step-time inputs (each field's docstring names its source or says "assumption"
and states the range)."""

MEMORY_RANGES: dict[str, Range] = {
    "cuda_context_gib": Range(0.5, 1.5, "low"),
    "nccl_gib_per_comm": Range(0.1, 0.5, "low"),
    "cuda_graph_gib": Range(1.0, 4.0, "low"),
    "vllm_workspace_gib": Range(1.0, 4.0, "low"),
    "fragmentation": Range(0.02, 0.15, "low"),
}
"""The ranged memory pools (``fast``: the end that needs less memory)."""


def _defaults(of: str):
    return Assumptions() if of == "assumptions" else Hardware()


def _user_set(name: str, r: Range, a: Assumptions, hw: Hardware) -> bool:
    obj = a if r.of == "assumptions" else hw
    return getattr(obj, name) != getattr(_defaults(r.of), name)


def _moved(
    a: Assumptions, hw: Hardware, items: dict[str, Range], faster: bool, names=None
) -> tuple[Assumptions, Hardware]:
    """``(a, hw)`` with the ranged fields ``names`` (default: every one still at its
    default) at their fast (``faster``) or slow end."""
    names = [n for n in items if not _user_set(n, items[n], a, hw)] if names is None else names
    ca = {n: items[n].end(faster) for n in names if items[n].of == "assumptions"}
    ch = {n: items[n].end(faster) for n in names if items[n].of == "hardware"}
    return dataclasses.replace(a, **ca), dataclasses.replace(hw, **ch)


def corner(a: Assumptions, faster: bool, hw: Hardware | None = None) -> Assumptions:
    """``a`` with every ranged assumption still at its default moved to its fast
    (``faster``) or slow end; fields the user set (``--assume``) stay as set."""
    return _moved(a, hw or Hardware(), RANGES, faster)[0]


def memory_corner(a: Assumptions) -> Assumptions:
    """``a`` with every memory pool not set by the user at the high end of its range."""
    return _moved(a, Hardware(), MEMORY_RANGES, False)[0]


StepFn = Callable[[Assumptions, Hardware], float]


def bounds(step_s: StepFn, a: Assumptions, hw: Hardware | None = None) -> dict[str, float]:
    """``{"low", "central", "high", "best", "worst"}`` seconds per step of ``step_s(a, hw)``
    (module doc)."""
    hw = hw or Hardware()
    central = step_s(a, hw)
    down = up = 0.0
    for name, r in RANGES.items():
        if _user_set(name, r, a, hw):
            continue  # set by the user: a point
        for faster in (True, False):
            d = step_s(*_moved(a, hw, RANGES, faster, [name])) - central
            if d < 0:
                down += d * d
            else:
                up += d * d
    return {
        "low": central - math.sqrt(down),
        "central": central,
        "high": central + math.sqrt(up),
        "best": step_s(*_moved(a, hw, RANGES, True)),
        "worst": step_s(*_moved(a, hw, RANGES, False)),
    }
