"""What a checkpoint may hold besides tensors: plain data (JSON types) and every RNG state as
tensors and plain types, so that resuming never unpickles an object (the format and the
save / restore of a run: :mod:`megagrpo.checkpoint.format`)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as tensors and plain types (numpy's MT19937 key as
    a list of ints: an ndarray would need unpickling)."""
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(name),
            "key": [int(k) for k in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (also the previous format's numpy tuple)."""
    random.setstate(_as_tuple(state["python"]))
    npy = state["numpy"]
    if isinstance(npy, dict):
        key = np.asarray(npy["key"], dtype=np.uint32)
        npy = (npy["bit_generator"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(obj: Any) -> Any:
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def to_plain(obj: Any, where: str = "state") -> Any:
    """``obj`` as JSON types: numpy scalars -> Python numbers, arrays and tuples -> lists.
    TypeError naming the path for anything else, so a field that cannot be checkpointed
    fails when saved (in the tests), not when a user resumes."""
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, str):  # subclasses: a str enum member
        return str.__str__(obj)
    for kind in (bool, int, float):  # subclasses: np.float64 is a float, IntEnum an int
        if isinstance(obj, kind):
            return kind(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (list, tuple)):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a string (not checkpointable)")
            out[k] = to_plain(v, f"{where}.{k}")
        return out
    raise TypeError(
        f"{where}: {type(obj).__name__} is not checkpointable (tensors go to rank files)"
    )


def json_bytes(obj: Any) -> bytes:
    """``obj`` (plain) as compact UTF-8 JSON."""
    # NaN/inf are legal in the state (e.g. a reward); json writes them as NaN/Infinity
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")
