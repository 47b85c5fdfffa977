"""The LoRA training state without a parallel layout: adapters and optimiser moments in HF
space, written in pieces by the ranks that own them, read back under any layout.

A *unit* is one factor of one HF weight's adapter: ``(name, "A")`` ``[r, in]`` or
``(name, "B")`` ``[out, r]`` (``name`` an HF weight such as
``model.layers.3.mlp.experts.7.gate_proj.weight``), the PEFT view of the adapter. A fused
Megatron linear (q/k/v, gate/up) has one A for all its projections: it is stored once, under
the first projection's name (:func:`a_unit_of`). Every optimiser state tensor shaped like its
parameter (AdamW's ``exp_avg`` / ``exp_avg_sq``) maps onto the same units element by element;
scalars (``step``) travel with each piece.

Writing (:func:`lora_pieces`): each rank emits the pieces it owns, exactly once over the
world: data-parallel rank 0 only (expert-data-parallel rank 0 for experts), the
TP-replicated factor (A of a column-parallel, B of a row-parallel linear) on TP rank 0 only
(expert-TP rank 0), the TP-sharded factor as the region of the unit this rank holds (the
placement plan's ``src`` slices, so q/k/v rows per query group and gate/up halves land where
a TP=1 layout holds them). A piece is ``{"name", "factor", "bounds": [[start, stop], ...],
"param": tensor, "state": {key: tensor}}`` (tensors and plain types only, so the
checkpoint reader's weights-only ``torch.load`` reads it).

Reading (:func:`load_lora_pieces`): every rank assembles the units its plan needs from the
pieces of *all* ranks of the saved layout (another TP / EP / PP / world size), checking that
each unit is covered exactly, and copies its own regions into the parameters and into freshly
built optimiser state. The values are copied, never recomputed: a resharded run continues
from bit-identical adapters and moments.

Why this format rather than torch DCP or megatron-core ``dist_checkpointing``: the LoRA state
is small next to the frozen base (which is never saved: it comes from ``model.hf_path``), the
placement plan that already maps every rank's shards onto HF tensors gives the global offsets
DCP would need DTensors for, the pieces are written in parallel (no gather of the whole fp32
adapter and its moments on one rank), and the same files give a PEFT adapter without building
a model (:mod:`megagrpo.commands.export`). The trainer's manifest, checksums and fsync stay
as they are (:mod:`megagrpo.checkpoint.format`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from megagrpo.errors import CheckpointError
from megagrpo.model.hf_mapping import hf_weight_shapes
from megagrpo.model.peft_export import lora_target

Bounds = list[list[int]]


def a_unit_of(name: str) -> str:
    """The HF name whose A unit holds ``name``'s A (q_proj for k/v, gate_proj for up)."""
    if re.search(r"\.self_attn\.[kv]_proj\.weight$", name):
        return re.sub(r"\.self_attn\.[kv]_proj\.", ".self_attn.q_proj.", name)
    if name.endswith(".up_proj.weight"):
        return name[: -len("up_proj.weight")] + "gate_proj.weight"
    return name


def unit_shape(name: str, factor: str, shapes: dict[str, tuple[int, ...]], rank: int) -> tuple:
    """``[r, in]`` for A, ``[out, r]`` for B of HF weight ``name``."""
    out, inp = shapes[name]
    return (rank, inp) if factor == "A" else (out, rank)


def targets(policy: Any) -> Iterator[tuple[str, str, bool]]:
    """``(hf_name, kind, is_expert)`` of every HF weight the policy's LoRA adapts."""
    for name in hf_weight_shapes(policy.arch):
        hit = lora_target(name, policy.cfg.lora.targets)
        if hit is not None:
            yield name, hit[0], hit[1]


def _local(policy: Any, param: str) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """``(A view, B view, A parameter, B parameter)`` for Megatron weight ``param`` (a view
    is one expert of a grouped-expert adapter, else the parameter itself)."""
    mod, _, leaf = param.rpartition(".")
    adapter = policy.adapters[mod]
    if adapter.num_experts:
        k = int(re.fullmatch(r"weight(\d+)", leaf).group(1))  # type: ignore[union-attr]
        return adapter.lora_A[k], adapter.lora_B[k], adapter.lora_A, adapter.lora_B
    return adapter.lora_A, adapter.lora_B, adapter.lora_A, adapter.lora_B


def _index(view: torch.Tensor, param: torch.Tensor) -> int | None:
    """Which expert of a grouped parameter ``view`` is (None: the parameter itself)."""
    if view is param:
        return None
    size = view.numel() * view.element_size()
    return (view.data_ptr() - param.data_ptr()) // size


def _states(optimizer: Any, view: torch.Tensor, param: Any) -> dict[str, torch.Tensor]:
    """The optimiser state of ``param`` restricted to ``view`` (scalars as they are)."""
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    k = _index(view, param)
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0:
            out[key] = value
        else:
            out[key] = value if k is None else value[k]
    return out


def _piece(name: str, factor: str, bounds: Bounds, region: tuple, view, param, optimizer) -> dict:
    states = _states(optimizer, view, param)
    cut = {k: (v if v.dim() == 0 else v[region]) for k, v in states.items()}
    return {
        "name": name,
        "factor": factor,
        "bounds": bounds,
        "param": view.detach()[region].to("cpu", copy=True).contiguous(),
        "state": {k: v.detach().to("cpu", copy=True).contiguous() for k, v in cut.items()},
    }


def _span(s: slice, size: int) -> list[int]:
    start, stop, _ = s.indices(size)
    return [start, stop]


def lora_pieces(policy: Any, optimizer: Any = None) -> list[dict]:
    """This rank's pieces of the layout-free LoRA state (see module docstring); no
    communication. ``optimizer``: its per-parameter state goes along (None: parameters only)."""
    g, r = policy.groups, policy.cfg.lora.rank
    shapes = hf_weight_shapes(policy.arch)
    out = []
    for name, kind, expert in targets(policy):
        if (g.expert_dp_rank if expert else g.dp_rank) != 0:
            continue  # another data-parallel replica writes it
        lead = (g.etp_rank if expert else g.tp_rank) == 0
        rows, cols = shapes[name]
        whole = False  # the replicated factor, once per name (q_proj: one piece per group)
        for p in policy.plan.get(name, []):
            if not p.owner:
                continue
            la, lb, pa, pb = _local(policy, p.param)
            if kind == "column":  # B rows sharded, A replicated
                bounds = [_span(p.src[0], rows), [0, r]]
                out.append(_piece(name, "B", bounds, (p.dst[0],), lb, pb, optimizer))
                if lead and not whole and a_unit_of(name) == name:
                    out.append(_piece(name, "A", [[0, r], [0, cols]], (), la, pa, optimizer))
                    whole = True
            else:  # A columns sharded, B replicated
                bounds = [[0, r], _span(p.src[1], cols)]
                region = (slice(None), p.dst[1])
                out.append(_piece(name, "A", bounds, region, la, pa, optimizer))
                if lead and not whole:
                    out.append(_piece(name, "B", [[0, rows], [0, r]], (), lb, pb, optimizer))
                    whole = True
    return out


class Units:
    """Full units assembled from the pieces of every saved rank (see module docstring)."""

    def __init__(self, pieces: list[dict], shapes: dict[str, tuple[int, ...]], rank: int):
        self.shapes, self.rank = shapes, rank
        self.index: dict[tuple[str, str], list[dict]] = {}
        for piece in pieces:
            self.index.setdefault((piece["name"], piece["factor"]), []).append(piece)
        self._cache: dict[tuple[str, str, str], torch.Tensor] = {}

    def keys(self, name: str, factor: str) -> set[str]:
        """Optimiser state keys saved for this unit."""
        return {k for p in self.index.get((name, factor), []) for k in p["state"]}

    def scalar(self, name: str, factor: str, key: str) -> torch.Tensor | None:
        for p in self.index.get((name, factor), []):
            value = p["state"].get(key)
            if value is not None and value.dim() == 0:
                return value
        return None

    def get(self, name: str, factor: str, what: str = "param") -> torch.Tensor:
        """The full unit ``[r, in]`` / ``[out, r]`` of ``what`` ("param" or a state key);
        CheckpointError when the pieces do not cover it exactly once."""
        key = (name, factor, what)
        if key in self._cache:
            return self._cache[key]
        pieces = self.index.get((name, factor), [])
        shape = unit_shape(name, factor, self.shapes, self.rank)
        full, seen, twice = None, torch.zeros(shape, dtype=torch.bool), False
        for p in pieces:
            t = p["param"] if what == "param" else p["state"].get(what)
            if t is None:
                continue
            if full is None:
                full = torch.zeros(shape, dtype=t.dtype)
            region = _region(p["bounds"], shape, tuple(t.shape), f"{factor} for '{name}'")
            twice = twice or bool(seen[region].any())
            seen[region] = True
            full[region] = t
        covered = int(seen.sum())
        if full is None or twice or covered != seen.numel():
            raise CheckpointError(
                f"LoRA checkpoint: {what} of {factor} for '{name}' covers {covered} of "
                f"{seen.numel()} elements" + (", some twice" if twice else " (pieces missing)")
            )
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = full
        return full


def _region(bounds: Any, shape: tuple, piece: tuple, what: str) -> tuple[slice, ...]:
    """The slices of ``bounds`` in a unit of ``shape``; CheckpointError when they leave it
    or do not match the piece's ``shape``."""
    ok = isinstance(bounds, (list, tuple)) and len(bounds) == len(shape)
    ok = ok and all(0 <= s < e <= n for (s, e), n in zip(bounds, shape, strict=True))
    if not ok:
        raise CheckpointError(f"LoRA checkpoint: {what}: bounds {bounds} outside {list(shape)}")
    if tuple(e - s for s, e in bounds) != piece:
        raise CheckpointError(f"LoRA checkpoint: {what}: piece {list(piece)} != bounds {bounds}")
    return tuple(slice(s, e) for s, e in bounds)


def _fill(view: torch.Tensor, region: tuple, src: torch.Tensor) -> None:
    with torch.no_grad():
        view[region] = src.to(view.device, view.dtype)


def load_lora_pieces(policy: Any, pieces: list[dict], optimizer: Any = None) -> int:
    """Copy the layout-free state into this rank's adapters (and, with ``optimizer``, into
    fresh optimiser state for every LoRA parameter); returns the number of regions copied.
    CheckpointError names a unit the pieces do not cover, or a shape that does not fit."""
    units = Units(pieces, hf_weight_shapes(policy.arch), policy.cfg.lora.rank)
    state_keys: dict[Any, set[str]] = {}
    copies = []
    for name, kind, _ in targets(policy):
        for p in policy.plan.get(name, []):
            la, lb, pa, pb = _local(policy, p.param)
            if kind == "column":
                copies.append((la, pa, (), a_unit_of(name), "A", ()))
                copies.append((lb, pb, (p.dst[0],), name, "B", (p.src[0],)))
            else:
                copies.append((la, pa, (slice(None), p.dst[1]), name, "A", (slice(None), p.src[1])))
                copies.append((lb, pb, (), name, "B", ()))
    for view, param, dst, unit, factor, src in copies:
        want = units.get(unit, factor)[src]
        if tuple(view[dst].shape) != tuple(want.shape):
            raise CheckpointError(
                f"LoRA checkpoint: '{unit}' {factor}{list(want.shape)} does not fit "
                f"{list(view[dst].shape)} (another model.lora.rank or model?)"
            )
        _fill(view, dst, want)
        state_keys.setdefault(param, set()).update(units.keys(unit, factor))
    if optimizer is not None:
        _init_state(optimizer, state_keys, copies, units)
    return len(copies)


def _init_state(optimizer: Any, state_keys: dict, copies: list, units: Units) -> None:
    """Optimiser state for every LoRA parameter, filled from the units (moments in the
    parameter's dtype and device; scalars such as ``step`` as saved)."""
    for param, keys in state_keys.items():
        if not keys:
            continue
        state = optimizer.state[param] = {}
        for key in sorted(keys):
            scalar = None
            for _, p, _, unit, factor, _ in copies:
                if p is param:
                    scalar = units.scalar(unit, factor, key)
                    break
            state[key] = scalar.clone() if scalar is not None else torch.zeros_like(param)
    for view, param, dst, unit, factor, src in copies:
        state = optimizer.state.get(param, {})
        k = _index(view, param)
        for key, value in state.items():
            if value.dim() == 0:
                continue
            target = value if k is None else value[k]
            _fill(target, dst, units.get(unit, factor, key)[src])


def lora_units(pieces: list[dict], arch: Any, lora_cfg: Any) -> dict[str, tuple]:
    """``{hf_name: (A [r, in], B [out, r])}`` (fp32 as saved) of every adapted HF weight,
    from the pieces alone (no model): what a PEFT adapter or a merged export needs."""
    shapes = hf_weight_shapes(arch)
    units = Units(pieces, shapes, lora_cfg.rank)
    out = {}
    for name in shapes:
        if lora_target(name, lora_cfg.targets) is not None:
            out[name] = (units.get(a_unit_of(name), "A").clone(), units.get(name, "B").clone())
    return out
