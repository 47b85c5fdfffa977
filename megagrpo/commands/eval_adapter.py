"""``megagrpo eval --adapter DIR``: a PEFT LoRA directory read without trusting its config.

An adapter from elsewhere (peft, ms-swift, another trainer) is evaluated as peft would apply
it, or refused naming what is wrong; never served at another scale:

- ``r`` must be the rank of the tensors (``lora_A [r, in]``, ``lora_B [out, r]``): an ``r``
  that disagrees would scale the update by ``alpha / r`` of another adapter;
- peft's per-module ``rank_pattern`` / ``alpha_pattern`` are honoured with peft's own
  matching rule (``(.*\\.)?KEY$`` on the module name, the first key in the file's order): the
  engines apply one ``alpha / r`` to every module, so each module's ``lora_B`` is rescaled
  to its own ``alpha_m / r_m`` and a smaller rank padded with zero rows (exact);
- every tensor finite, ``lora_alpha`` finite and the update within float32 (NaN or inf is
  named as the adapter's, not found later as a mismatch in the engine's weight check);
- with the base model's directory: every adapted module a weight of that model, of the
  shapes the tensors need (``in`` of ``lora_A``, ``out`` of ``lora_B``).

rsLoRA, DoRA and other PEFT types are refused; ``alpha_pattern`` / ``rank_pattern`` on
peft's fused experts (``target_parameters``) too.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38


def read_adapter_config(cfg_file: Path) -> dict[str, Any]:
    """``adapter_config.json`` as a dict; ConfigError naming the file when it is unreadable,
    not JSON or not an object."""
    try:
        conf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"--adapter: {cfg_file}: unreadable ({str(exc)[:200]})") from None
    if not isinstance(conf, dict):
        raise ConfigError(f"--adapter: {cfg_file}: expected a JSON object")
    return conf


def _number(conf: dict, key: str, where: str, integer: bool = False) -> float:
    value = conf.get(key)
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
    if not (math.isfinite(number) and number > 0) or (integer and number != int(number)):
        kind = "a positive integer" if integer else "a positive finite number"
        raise ConfigError(f"{where}: '{key}' must be {kind}, got {value!r}")
    return number


def _pattern(conf: dict, key: str, where: str, integer: bool) -> dict[str, float]:
    pattern = conf.get(key) or {}
    if not isinstance(pattern, dict):
        raise ConfigError(f"{where}: '{key}' must be an object, got {pattern!r:.80}")
    for k in pattern:
        try:
            re.compile(k)
        except re.error as exc:
            raise ConfigError(f"{where}: '{key}' key {k!r} is not a regular expression") from exc
    return {k: _number(pattern, k, f"{where}: '{key}'", integer) for k in pattern}


def pattern_value(pattern: dict[str, float], module: str, default: float) -> float:
    """peft's ``get_pattern_key``: the first key of ``pattern`` with ``(.*\\.)?KEY$``
    matching the module name, else ``default``."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_state(weights: Path, where: str) -> dict[str, Any]:
    """The adapter's tensors; ConfigError naming the file and the first non-finite tensor."""
    import torch
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights))
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends
        raise ConfigError(f"{where}: {weights.name} unreadable ({str(exc)[:200]})") from exc
    for key, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ConfigError(
                f"{where}: {weights.name}: tensor {key} holds {bad} NaN or infinite values: the "
                "adapter is broken (a diverged run?), not the engine"
            )
    return state


def base_shapes(model_dir: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """``{weight name: shape}`` of the base model (per-expert names), from its config; None
    for an architecture megagrpo does not map."""
    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.hf_mapping import hf_weight_shapes

    try:
        return hf_weight_shapes(arch_from_hf(load_hf_config(Path(model_dir))))
    except Exception:  # noqa: BLE001 - another architecture: the merge names it later
        return None


def check_module(where: str, module: str, a: Any, b: Any, r: int, shapes: dict | None) -> None:
    """One module's factors against its rank and the base weight's shape."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
        raise ConfigError(
            f"{where}: module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
            f"not of rank {r} (adapter_config.json's r / rank_pattern): it would be applied "
            "at another scale"
        )
    if shapes is None:
        return
    want = shapes.get(f"{module}.weight")
    if want is None:
        raise ConfigError(f"{where}: module {module} is not a weight of the base model")
    if (b.shape[0], a.shape[1]) != tuple(want):
        raise ConfigError(
            f"{where}: module {module}: lora_B @ lora_A is {b.shape[0]}x{a.shape[1]}, the base "
            f"weight {want[0]}x{want[1]}: an adapter of another model"
        )


def load_adapter(path: str | os.PathLike, model_dir: str | os.PathLike | None = None) -> Any:
    """A PEFT LoRA directory as a :class:`megagrpo.rollout.PeftAdapter` (per-module A/B,
    one scale), checked as the module docstring says (``model_dir``: also against the base
    model's shapes). ConfigError naming the directory, key, module or tensor."""
    from megagrpo.rollout import PeftAdapter
    from megagrpo.rollout.lora import unfuse_experts

    path = Path(path)
    where = f"--adapter {path}"
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise ConfigError(f"{where}: needs adapter_config.json and adapter_model.safetensors")
    conf = read_adapter_config(cfg_file)
    if conf.get("peft_type", "LORA") != "LORA" or conf.get("use_rslora") or conf.get("use_dora"):
        raise ConfigError(f"{where}: only plain LoRA adapters are supported")
    r = int(_number(conf, "r", where, integer=True))
    alpha = _number(conf, "lora_alpha", where)
    ranks = _pattern(conf, "rank_pattern", where, integer=True)
    alphas = _pattern(conf, "alpha_pattern", where, integer=False)
    state = read_state(weights, where)
    try:
        if conf.get("target_parameters"):  # peft's fused experts: per expert for the engine
            if ranks or alphas:
                raise ConfigError(
                    f"{where}: rank_pattern / alpha_pattern with target_parameters (fused "
                    "experts) are not supported: export the adapter without them"
                )
            state = unfuse_experts(state, list(conf["target_parameters"]), r)
        adapter = PeftAdapter.from_peft_state_dict(state, r, alpha)
    except (KeyError, ValueError, RuntimeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}: {exc}") from exc
    return _uniform(adapter, where, ranks, alphas, base_shapes(model_dir) if model_dir else None)


def _uniform(adapter: Any, where: str, ranks: dict, alphas: dict, shapes: dict | None) -> Any:
    """``adapter`` with every module's factors checked and, under rank / alpha patterns,
    rescaled (and zero-padded) to one rank and one scale."""
    import torch

    r, alpha = adapter.rank, adapter.alpha
    own = {m: (int(pattern_value(ranks, m, r)), pattern_value(alphas, m, alpha)) for m in adapter.a}
    for m, (r_m, _) in own.items():
        check_module(where, m, adapter.a[m], adapter.b[m], r_m, shapes)
    top = max(r_m for r_m, _ in own.values())
    if ranks or alphas:  # one rank, scale 1: B_m carries alpha_m / r_m
        adapter.rank, adapter.alpha = top, float(top)
        for m, (r_m, alpha_m) in own.items():
            a, b = adapter.a[m].float(), adapter.b[m].float() * (alpha_m / r_m)
            adapter.a[m] = torch.cat([a, a.new_zeros(top - r_m, a.shape[1])])
            adapter.b[m] = torch.cat([b, b.new_zeros(b.shape[0], top - r_m)], dim=1)
    scale = adapter.alpha / adapter.rank
    for m in adapter.a:
        a_max, b_max = (float(t.abs().max()) for t in (adapter.a[m], adapter.b[m]))
        if scale * a_max * b_max * adapter.rank >= FLOAT32_MAX:
            raise ConfigError(
                f"{where}: module {m}: lora_alpha / r = {scale:.3g} times its factors "
                "overflows float32: the adapter's lora_alpha is not usable"
            )
    return adapter
