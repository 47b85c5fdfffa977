"""How much of a LoRA update a merged sync delivers, predicted before anything runs.

A merged sync sends ``cast(W + dW)`` (the sum in fp32, cast to ``model.dtype``; an engine of
lower precision casts again, an FP8 engine re-quantises per tensor). What the engine receives
of the update, projected on it, is ``sync/lora_survival``
(:mod:`megagrpo.model.merge_precision` measures it after each sync); this module predicts it
for a run's lr, warm-up, schedule, LoRA rank / alpha and the model's weight scales, so the
planner and the trainer can call a layout **exact** or **lossy** before a step runs.

The model, per element (``d`` = the element of ``dW``, ``w`` = of ``W``):

* ``dW = (alpha / r) B A``: A is PEFT's kaiming-uniform init (``U(-1/sqrt(in), 1/sqrt(in))``,
  :func:`megagrpo.model.lora.kaiming_a`), B starts at 0 and Adam moves each entry by about the
  learning rate per step (exactly ``lr`` at step 1). After ``k`` optimiser steps each B entry
  is between ``sqrt(sum lr_j^2)`` (noise-dominated updates, a random walk: the **low** bound)
  and ``sum lr_j`` (coherent updates: the **high** bound), so ``d ~ N(0, s_d^2)`` with
  ``s_d = (alpha / r) b sqrt(r / (3 in))``.
* ``w ~ N(0, s_w^2)`` on the grid of its dtype (bf16: 7 mantissa bits, a spacing of
  ``2^(e - 7)`` for ``|w|`` in ``[2^e, 2^(e+1))``). Rounding to nearest moves ``w`` by
  ``u round(d / u)``: with ``rho = u / s_d`` the expected projection is
  ``E[d q(d)] / s_d^2 = 2 rho sum_k phi((k - 1/2) rho)`` (closed form, summed over the
  binades of ``|w|``). Small updates round back to ``w``: a bias toward the base.
* FP8 (``rollout.quantization=fp8``, per-tensor scale): the base is not on the FP8 grid, so
  re-quantisation is dithered: unbiased in expectation, but each element moves by a whole
  FP8 spacing (3 mantissa bits) with probability ``|d| / u``: noise
  ``u^2 E[f (1 - f)]``, ``f = frac(|d| / u)``, 25-125x the update's norm at early sizes.

A layout is **exact** when the low bound keeps >= :data:`EXACT_SURVIVAL` of the update and the
noise stays <= :data:`EXACT_NOISE` of its norm at every reported step (:data:`REPORT_STEPS`);
else **lossy**. ``tests/unit/test_sync_survival.py`` checks the prediction against merging a
real LoRA delta into bf16 weights with torch and measuring what survives.

Weight scales: read from the HF checkpoint when it is readable (:func:`checkpoint_weight_stds`),
else :data:`ASSUMED_WEIGHT_STD` (an assumption; :data:`WEIGHT_STD_RANGE` bounds it: only
``dW / W`` matters, so halving the scale roughly doubles early survival).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10, "fp8": 3}
"""Explicit mantissa bits of each weight format (fp8: e4m3, vLLM's online FP8)."""

REPORT_STEPS = (1, 10, 50)
"""Optimiser steps whose predicted survival the planner and the trainer print."""
EXACT_SURVIVAL = 0.99
"""Fewest of the update (low bound) an exact sync delivers at every reported step."""
EXACT_NOISE = 0.1
"""Most rounding noise (of the update's norm) an exact sync adds at every reported step."""
WARN_SURVIVAL = 0.9
"""The trainer warns on every sync whose measured ``sync/lora_survival`` is below this."""
ASSUMED_WEIGHT_STD = 0.02
"""Std of a weight matrix when the checkpoint is not readable. Assumption: Qwen3 / Llama
initialise at 0.02 (``initializer_range``) and trained matrices stay within 0.01-0.04."""
WEIGHT_STD_RANGE = (0.01, 0.04)
"""The range :data:`ASSUMED_WEIGHT_STD` is printed with (an assumption, scale-audit-3 s3)."""


# ------------------------------------------------------------------ learning rate


def lr_factors(
    steps: int, warmup: int, schedule: str = "constant", total: int = 0, min_ratio: float = 0.0
) -> np.ndarray:
    """``[steps]`` learning-rate factor of optimiser steps 1..``steps`` as the trainer's
    transformers schedulers give it (``megagrpo.trainer.setup.lr_scheduler``): the scheduler
    is stepped after each optimiser step, so step ``k`` runs at ``lambda(k - 1)`` and the
    first step of a warm-up moves nothing. ``schedule``: constant (constant_with_warmup) |
    cosine (cosine_with_min_lr) | linear (warmup_stable_decay, linear decay to
    ``min_ratio``)."""
    s = np.arange(steps, dtype=np.float64)
    out = np.ones(steps)
    warm = s < warmup
    out[warm] = s[warm] / max(1, warmup)
    if schedule == "constant":
        return out
    progress = np.clip((s - warmup) / max(1, total - warmup), 0.0, 1.0)
    if schedule == "cosine":
        decay = 0.5 * (1.0 + np.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    decay = decay * (1.0 - min_ratio) + min_ratio
    if schedule == "linear":  # warmup_stable_decay warms up from min_lr_ratio too
        out = min_ratio + (1.0 - min_ratio) * out
    return np.where(warm, out, decay)


def b_bounds(lr: float, factors: np.ndarray, k: int) -> tuple[float, float]:
    """``(noise-dominated, coherent)`` magnitude of a B entry after ``k`` Adam steps."""
    f = lr * factors[:k]
    return float(np.sqrt((f * f).sum())), float(f.sum())


# ------------------------------------------------------------------ one element


def _phi(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _upper(x: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc)(x / math.sqrt(2.0))


def rounding_moments(rho: float) -> tuple[float, float]:
    """``(E[d q] / s^2, E[(q - d)^2] / s^2)`` for ``d ~ N(0, s^2)`` rounded to a grid of
    spacing ``u = rho s`` that holds 0 (module doc)."""
    if rho < 0.05:  # many grid points per std: uniform rounding error
        return 1.0, rho * rho / 12.0
    k = np.arange(1, int(math.ceil(10.0 / rho)) + 2, dtype=np.float64)
    dot = 2 * rho * float(_phi((k - 0.5) * rho).sum())
    q2 = 2 * rho * rho * float(((2 * k - 1) * _upper((k - 0.5) * rho)).sum())
    return dot, q2 - 2 * dot + 1.0


_Z = np.linspace(-9.0, 9.0, 36001)
_WZ = _phi(_Z) * (_Z[1] - _Z[0])


def dither_noise(rho: float) -> float:
    """``E[(q(w + d) - q(w) - d)^2] / s^2`` for ``d ~ N(0, s^2)`` and ``w`` uniform within its
    grid cell of spacing ``u = rho s`` (re-quantisation of a base that is not on the grid):
    ``rho^2 E[f (1 - f)]``, ``f = frac(|d| / u)``."""
    if rho < 0.05:
        return rho * rho / 6.0
    f = np.mod(np.abs(_Z) / rho, 1.0)
    return rho * rho * float((_WZ * f * (1 - f)).sum())


def requant_noise(rho: float, ratio: float) -> float:
    """:func:`dither_noise` of an update first rounded to a grid of spacing ``rho s`` (the
    bf16 merge): only the elements it moved move again, by whole steps of the coarser grid
    ``ratio x`` wider (FP8 after bf16: 2^(7-3))."""
    if rho < 0.05:
        return dither_noise(rho * ratio)
    k = np.arange(1, int(math.ceil(10.0 / rho)) + 2, dtype=np.float64)
    p = _upper((k - 0.5) * rho) - _upper((k + 0.5) * rho)  # P(q = +k u), one side
    f = np.mod(k / ratio, 1.0)
    return 2 * float((p * f * (1 - f)).sum()) * (rho * ratio) ** 2


def element_survival(
    sigma_d: float, sigma_w: float, fmt: str, requant: str | None = None
) -> tuple[float, float]:
    """``(survival, noise)`` of an update ``d ~ N(0, sigma_d^2)`` on weights ``w ~ N(0,
    sigma_w^2)`` on the grid of format ``fmt`` (:data:`MANTISSA_BITS`): survival =
    ``E[<q - w, d>] / E[d^2]``, noise = ``sqrt(E[(q - w - d)^2] / E[d^2])``, summed over the
    binades of ``|w|``. ``requant`` (fp8): the merged weights are then re-quantised to that
    coarser format, whose grid the base is not on (unbiased, noisier)."""
    if sigma_d <= 0:
        return 1.0, 0.0
    m = MANTISSA_BITS[fmt]
    ratio = 2.0 ** (m - MANTISSA_BITS[requant]) if requant else 0.0
    top = int(math.floor(math.log2(sigma_w))) + 6
    edges = 2.0 ** np.arange(top - 48, top + 1, dtype=np.float64)
    mass = 2 * (_upper(edges[:-1] / sigma_w) - _upper(edges[1:] / sigma_w))
    below = 1.0 - 2 * float(_upper(np.array([edges[0] / sigma_w]))[0])  # |w| < 2^(top-48)
    surv, err = below * 1.0, 0.0
    for lo, p in zip(edges[:-1], mass):
        if p < 1e-15:
            continue
        rho = lo * 2.0**-m / sigma_d
        dot, e2 = rounding_moments(rho)
        if requant:
            e2 += requant_noise(rho, ratio)
        surv, err = surv + p * dot, err + p * e2
    return surv, math.sqrt(max(err, 0.0))


# ------------------------------------------------------------------ a whole adapter


@dataclass(frozen=True)
class TargetShape:
    """The adapted matrices of one LoRA target: ``fan_in`` (A's input), ``numel`` (weights
    of every adapted matrix of the model), ``name`` (the target)."""

    name: str
    fan_in: int
    numel: float


def target_shapes(hf: dict, targets: Sequence[str]) -> list[TargetShape]:
    """:class:`TargetShape` of each LoRA target of the model of HF config ``hf``."""
    from megagrpo.model.arch import arch_from_hf

    a = arch_from_hf(hf)
    moe = sum(1 for x in (a.moe_layers or []) if x) if a.is_moe else 0
    dense = a.num_layers - moe
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out = []
    if "linear_qkv" in targets:
        out.append(
            TargetShape("linear_qkv", a.hidden_size, a.num_layers * a.hidden_size * (q + 2 * kv))
        )
    if "linear_proj" in targets:
        out.append(TargetShape("linear_proj", q, a.num_layers * q * a.hidden_size))
    for fc in ("linear_fc1", "linear_fc2"):
        both, experts_only = fc in targets, f"expert_{fc}" in targets
        mlp = a.hidden_size * a.ffn_hidden_size * (2 if fc == "linear_fc1" else 1)
        if both and dense:
            fan = a.hidden_size if fc == "linear_fc1" else a.ffn_hidden_size
            out.append(TargetShape(fc, fan, dense * mlp))
        if (both or experts_only) and moe:
            ffn = a.moe_ffn_hidden_size
            fan = a.hidden_size if fc == "linear_fc1" else ffn
            per = a.hidden_size * ffn * (2 if fc == "linear_fc1" else 1)
            out.append(TargetShape(f"expert_{fc}", fan, moe * a.num_experts * per))
    return out


def known_shapes(hf: dict | None, targets: Sequence[str]) -> list[TargetShape] | None:
    """:func:`target_shapes`, or None when ``hf`` is missing or not a supported model (a test
    engine's stand-in config): nothing to predict from."""
    from megagrpo.errors import ConfigError

    if not hf or not targets:
        return None
    try:
        return target_shapes(hf, targets) or None
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


@dataclass
class SurvivalPrediction:
    """Predicted survival of a merged sync at :data:`REPORT_STEPS` (module doc)."""

    fmt: str
    """The weight format the update is rounded to (the lower of the trainer's and the
    engine's; ``fp8``: re-quantised after a bf16 merge)."""
    steps: tuple[int, ...]
    low: list[float]
    """Survival with noise-dominated Adam updates (and the heaviest assumed weights)."""
    high: list[float]
    """Survival with coherent updates (and the lightest assumed weights)."""
    noise: list[float]
    """Rounding noise over the update's norm (noise-dominated updates: the larger)."""
    moved: list[bool]
    """Whether the update is non-zero at each step (a warm-up's first step moves nothing)."""
    weight_std: dict[str, float]
    weight_source: str
    """"checkpoint <dir>" or "assumption ..." (:data:`ASSUMED_WEIGHT_STD`)."""
    exact: bool = False
    notes: list[str] = field(default_factory=list)

    def steps_text(self) -> str:
        """``step 1: no update yet (lr warm-up), step 10: 3%-34%, ...`` (low-high)."""
        parts = []
        for k, lo, hi, mv in zip(self.steps, self.low, self.high, self.moved):
            if not mv:
                parts.append(f"step {k}: no update yet (lr warm-up)")
            elif abs(hi - lo) < 0.005:
                parts.append(f"step {k}: {lo:.0%}")
            else:
                parts.append(f"step {k}: {lo:.0%}-{hi:.0%}")
        return ", ".join(parts)

    def summary(self) -> str:
        """One line: survival at each step, the noise, where the weight scales came from."""
        noise = max((n for n, mv in zip(self.noise, self.moved) if mv), default=0.0)
        return (
            f"predicted survival of the LoRA update through a {self.fmt} merge: "
            + self.steps_text()
            + f"; rounding noise up to {noise:.2g}x the update; weight scales: {self.weight_source}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.fmt,
            "steps": list(self.steps),
            "low": self.low,
            "high": self.high,
            "noise": self.noise,
            "moved": self.moved,
            "exact": self.exact,
            "weight_std": self.weight_std,
            "weight_source": self.weight_source,
        }


def merge_format(trainer_dtype: str, engine_dtype: str, quantization: str = "none") -> str:
    """The format a merged update ends in: the coarser of the trainer's ``model.dtype`` (the
    merge casts to it) and the engine's dtype; ``fp8`` when the engine re-quantises."""
    if quantization == "fp8":
        return "fp8"
    return min((trainer_dtype, engine_dtype), key=lambda d: MANTISSA_BITS.get(d, 23))


def predict_survival(
    *,
    fmt: str,
    lr: float,
    rank: int,
    alpha: float,
    shapes: Sequence[TargetShape],
    warmup: int = 0,
    schedule: str = "constant",
    total_steps: int = 0,
    min_ratio: float = 0.0,
    weight_std: dict[str, float] | None = None,
    weight_source: str = "",
    steps: Sequence[int] = REPORT_STEPS,
    base_fmt: str = "bfloat16",
) -> SurvivalPrediction:
    """Survival of a merged sync's LoRA update at each of ``steps`` (module doc).
    ``weight_std``: std per target name (:func:`checkpoint_weight_stds`); None: the
    assumption, printed with its range. ``fmt`` fp8: the update is first rounded to
    ``base_fmt`` (the merge), then re-quantised (dithered)."""
    assumed = weight_std is None
    stds = weight_std or {}
    source = weight_source or (
        f"assumption W std {ASSUMED_WEIGHT_STD} ({WEIGHT_STD_RANGE[0]}-{WEIGHT_STD_RANGE[1]}; "
        "the checkpoint is not readable here)"
    )
    factors = lr_factors(max(steps), warmup, schedule, total_steps, min_ratio)
    scale = alpha / rank
    low, high, noise, moved = [], [], [], []
    for k in steps:
        b_noise, b_coh = b_bounds(lr, factors, k)
        moved.append(b_coh > 0)
        cases = []
        for b, w_mult in (
            (b_noise, WEIGHT_STD_RANGE[1] / ASSUMED_WEIGHT_STD),
            (b_coh, WEIGHT_STD_RANGE[0] / ASSUMED_WEIGHT_STD),
        ):
            cases.append(
                _adapter(fmt, base_fmt, b, scale, rank, shapes, stds, w_mult if assumed else 1.0)
            )
        (lo, n_lo), (hi, _) = cases
        low.append(float(lo))
        high.append(float(hi))
        noise.append(float(n_lo))
    used = {s.name: stds.get(s.name, ASSUMED_WEIGHT_STD) for s in shapes}
    pred = SurvivalPrediction(fmt, tuple(steps), low, high, noise, moved, used, source)
    pred.exact = all(
        (lo >= EXACT_SURVIVAL and n <= EXACT_NOISE) or not mv
        for lo, n, mv in zip(low, noise, moved)
    )
    return pred


def _adapter(
    fmt: str,
    base_fmt: str,
    b: float,
    scale: float,
    rank: int,
    shapes: Sequence[TargetShape],
    stds: dict[str, float],
    w_mult: float,
) -> tuple[float, float]:
    """Survival and noise of the whole adapter's update: each target weighted by its share of
    ``||dW||^2`` (``numel x s_d^2``), as ``sync/lora_survival`` sums it."""
    num = den = err = 0.0
    for t in shapes:
        s_d = scale * b * math.sqrt(rank / (3.0 * t.fan_in))
        s_w = stds.get(t.name, ASSUMED_WEIGHT_STD) * w_mult
        if fmt == "fp8":
            surv, n = element_survival(s_d, s_w, base_fmt, requant="fp8")
        else:
            surv, n = element_survival(s_d, s_w, fmt)
        wgt = t.numel * s_d * s_d
        num, den, err = num + wgt * surv, den + wgt, err + wgt * n * n
    if den == 0:
        return 1.0, 0.0
    return num / den, math.sqrt(err / den)


# ------------------------------------------------------------------ the checkpoint's scales

_HF_NAMES = {
    "linear_qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "linear_proj": ("self_attn.o_proj.weight",),
    "linear_fc1": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "linear_fc2": ("mlp.down_proj.weight",),
    "expert_linear_fc1": ("mlp.experts.0.gate_proj.weight", "mlp.experts.0.up_proj.weight"),
    "expert_linear_fc2": ("mlp.experts.0.down_proj.weight",),
}


def checkpoint_weight_stds(
    model_dir: str | Path, shapes: Sequence[TargetShape]
) -> dict[str, float] | None:
    """Std of each target's weights in the HF safetensors checkpoint at ``model_dir``
    (layers 0, the middle one and the last; expert 0 of MoE layers), read lazily (a few
    tensors, not the model); None when the directory holds no readable safetensors."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            where = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        elif (root / "model.safetensors").is_file():
            where = None
        else:
            return None
        from safetensors import safe_open
    except (OSError, ValueError, KeyError, ImportError):
        return None
    files: dict[str, Any] = {}
    out: dict[str, float] = {}
    try:
        for t in shapes:
            vals = _target_values(root, where, files, t.name, safe_open)
            if vals:
                sq = sum(float((v.double() ** 2).sum()) for v in vals)
                n = sum(v.numel() for v in vals)
                out[t.name] = math.sqrt(sq / n)
    except (OSError, ValueError, KeyError, RuntimeError):
        return None
    return out or None


def _target_values(root: Path, where: dict | None, files: dict, target: str, safe_open) -> list:
    names = _HF_NAMES[target]
    keys = sorted(where) if where is not None else None
    if keys is None:
        f = files.setdefault("model.safetensors", safe_open(root / "model.safetensors", "pt"))
        keys = sorted(f.keys())
    layers = sorted({int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")})
    if not layers:
        return []
    picked = {layers[0], layers[len(layers) // 2], layers[-1]}
    vals = []
    for i in sorted(picked):
        for n in names:
            key = f"model.layers.{i}.{n}"
            shard = where.get(key) if where is not None else "model.safetensors"
            if shard is None or (where is None and key not in keys):
                continue
            f = files.setdefault(shard, safe_open(root / shard, "pt"))
            vals.append(f.get_tensor(key))
    return vals
