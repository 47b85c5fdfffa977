"""Which planned layouts can run: the config keys of a :class:`~megagrpo.plan.scenario.Scenario`
and the verdict of the compatibility gate on them.

The planner (this package) does not import the trainer; the command that plans
(`megagrpo plan-memory`) passes in a :data:`Gate` that applies :func:`settings_of` to the run
config and asks ``megagrpo.gate.compat`` (the pinned vLLM / megatron-core rules) about it.
Every layout the planner prints, searches or ships has one status:

* **exact**: the gate passes it, the engines sample the policy the trainer trains, nothing in
  it is unverified;
* **lossy**: its weight sync delivers only part of the LoRA update (a merged sync into a bf16
  or FP8 engine: :mod:`megagrpo.plan.exactness`), printed with the predicted survival; the
  trainer refuses it unless ``trainer.allow_lossy_sync``; ``--gpus N`` ranks it only with
  ``--allow-lossy``;
* **unverified**: the gate passes it but it has not run on a GPU yet (FP8 rollout weights
  with LoRA on the experts: the gate follows vLLM 0.33's source, no GPU has run it);
* **refused**: the gate names a rule it breaks.

A layout that is several of these takes the first in the order refused, lossy, unverified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megagrpo.plan.exactness import lossy_notes
from megagrpo.plan.scenario import Scenario

EXACT, LOSSY, UNVERIFIED, REFUSED = "exact", "lossy", "unverified", "refused"
STATUSES = (EXACT, LOSSY, UNVERIFIED, REFUSED)

FP8_UNVERIFIED = "rollout.quantization=fp8: unverified on GPU (no GPU has run FP8 + LoRA yet)"


@dataclass(frozen=True)
class Verdict:
    """The gate's answer for one layout: the rules it breaks (``refused``), what in it has
    not run on a GPU (``unverified``) and why its sync is lossy (``lossy``)."""

    refused: tuple[str, ...] = ()
    unverified: tuple[str, ...] = field(default=())
    lossy: tuple[str, ...] = field(default=())

    @property
    def status(self) -> str:
        if self.refused:
            return REFUSED
        if self.lossy:
            return LOSSY
        return UNVERIFIED if self.unverified else EXACT

    def note(self) -> str:
        """One line: the refusing rules (their names), else why it is lossy, else what is
        unverified, else ``exact``."""
        if self.refused:
            return "REFUSED: " + ", ".join(r.split(" ", 1)[0] for r in self.refused)
        if self.lossy:
            return "LOSSY: " + "; ".join(self.lossy + self.unverified)
        if self.unverified:
            return "UNVERIFIED: " + "; ".join(self.unverified)
        return EXACT

    def detail(self) -> str:
        """:meth:`note` with each refusing rule's reason."""
        return "REFUSED: " + "; ".join(self.refused) if self.refused else self.note()


Gate = Callable[[Scenario], Verdict]
"""``scenario -> Verdict`` (built by the command from the run config and the gate)."""


def planner_unverified(sc: Scenario) -> tuple[str, ...]:
    """What the planner itself marks unverified in ``sc``: FP8 rollout weights."""
    return (FP8_UNVERIFIED,) if sc.quantization == "fp8" else ()


def ungated(sc: Scenario) -> Verdict:
    """The verdict without a gate (library use, tests of the arithmetic): nothing refused,
    FP8 unverified, a merged sync lossy where the survival model says so."""
    return Verdict((), planner_unverified(sc), lossy_notes(sc))


def settings_of(sc: Scenario) -> list[tuple[str, Any]]:
    """``(dotted config key, value)`` of every key a planned layout sets (what
    ``plan-memory`` prints as overrides, and what the gate is asked about)."""
    separate = sc.placement == "separate"
    out: list[tuple[str, Any]] = [
        ("cluster.num_nodes", max(1, sc.num_gpus // sc.gpus_per_node)),
        ("parallel.tp", sc.tp),
        ("parallel.pp", sc.pp),
        ("parallel.ep", sc.ep),
        ("parallel.etp", sc.etp),
        ("parallel.sequence_parallel", bool(sc.sequence_parallel)),
        ("rollout.tensor_parallel_size", sc.vllm_tp),
        ("rollout.enable_expert_parallel", bool(sc.enable_expert_parallel)),
        ("rollout.gpu_memory_utilization", sc.gpu_memory_utilization),
        ("rollout.enable_lora", bool(sc.enable_lora)),
        ("rollout.replicas", sc.replicas),
        ("rollout.quantization", sc.quantization),
        ("rollout.load_format", sc.load_format),
        ("rollout.partial.enabled", sc.partial_finish_fraction > 0),
        *(
            [
                ("rollout.partial.finish_fraction", sc.partial_finish_fraction),
                ("rollout.partial.max_staleness", sc.partial_max_staleness),
                ("rollout.partial.chunk_tokens", sc.partial_chunk_tokens),
            ]
            if sc.partial_finish_fraction > 0
            else []
        ),
        ("rollout.placement", "separate" if separate else "auto"),
        ("rollout.engine_ranks", sc.rollout_gpus if separate else 1),
        ("rollout.max_staleness", sc.offpolicy_staleness if separate else 0),
        ("trainer.weight_sync", sc.weight_sync),
        ("trainer.adapter_transport", sc.adapter_transport),
        ("trainer.offload_during_rollout", bool(sc.offload_during_rollout)),
        ("trainer.sync_transport", sc.sync_transport),
    ]
    if lossy_notes(sc):  # the trainer refuses a lossy sync unless the config consents
        out.append(("trainer.allow_lossy_sync", True))
    return out


def overrides_of(sc: Scenario) -> list[str]:
    """:func:`settings_of` as ``key=value`` overrides (lower-case booleans)."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings_of(sc)]
