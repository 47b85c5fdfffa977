"""Strict device mode: NCCL's device rule, enforced and visible on CPU.

On GPU, torch maps a plain ``nccl`` backend to CUDA tensors only, so a CPU tensor handed to
``all_reduce`` raises, and a loss whose targets stayed on the host fails in the Triton launch
(or with a device mismatch). gloo accepts CPU tensors and a CPU run has only one device, so
the CPU suite cannot see either. This module makes both visible:

* :func:`strict_devices` patches the ``torch.distributed`` collectives so that every tensor
  handed to one must sit on the declared compute device (``ParallelGroups.device``), and
  turns on :func:`check_on_device`, the hook the trainer calls on the loss inputs.
* With a declared device of ``cpu`` (a CPU run) it *emulates* a separate compute device:
  ``groups.device`` becomes ``cuda:0`` while every tensor physically stays on the CPU. A
  ``TorchFunctionMode`` tracks which tensors are "on the host" (made by a factory without a
  device, ``torch.tensor(list)``, ``torch.from_numpy``, ``.cpu()``, ``.to("cpu")``, or
  computed only from such tensors) and which are "on the device" (parameters and buffers
  that existed before, ``device=groups.device`` / ``torch.cuda.current_device()``,
  ``.to(groups.device)``, ``.cuda()``, or computed from a device tensor); ``p.data = t``
  gives ``p`` the placement of ``t`` (how offloading moves a parameter). ``t.device``
  reports ``cuda:0`` or ``cpu`` accordingly, and, as on CUDA, an op that mixes a device
  tensor with a host tensor of dimension > 0 raises (0-dim host tensors are scalars; copies
  and indexing may cross). ``torch.cuda.is_available()`` stays False, so everything else
  (gloo, the Megatron CPU shims, the Triton interpreter) runs as on any CPU run.
* On a real GPU (declared ``cuda:N``) nothing is emulated: the checks compare real devices.

    with strict_devices(groups):          # declared: groups.device (emulated if cpu)
        metrics = train_step(ctx)         # DeviceError at the first host tensor handed to a
                                          # collective or to check_on_device("loss", ...)

Limits: a tensor created with an explicit ``device="cpu"`` counts as host, one created from
``x.device`` follows ``x``; a tensor loaded by ``torch.load`` or made by C++ code outside
the torch API counts as device. The autograd backward pass (``loss.backward()``) runs outside
the emulation (torch hands it to the mode as one call): tensors made in backward count as
device and are not checked for mixing; collectives called from backward are still checked.
The emulation costs a Python call per torch call: use it on tiny models (the CPU suite), not
for benchmarks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger(__name__)

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
"""``torch.distributed`` functions whose tensors must be on the compute device (NCCL: CUDA)."""

ENV = "MEGAGRPO_STRICT_DEVICES"
"""Set to 1 to ask the trainer for strict mode (:func:`strict_from_env`)."""

_HOST = "_megagrpo_host"
_VIRTUAL = torch.device("cuda", 0)
_STATE: dict[str, Any] = {"declared": None, "emulated": False}


class DeviceError(RuntimeError):
    """A tensor is on the host where the compute device is required (what NCCL/Triton
    would reject on a GPU)."""


def strict_active() -> bool:
    """True inside :func:`strict_devices`."""
    return _STATE["declared"] is not None


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the host under the current mode (real device outside emulation)."""
    if _STATE["emulated"]:
        return bool(getattr(t, _HOST, False))
    declared = _STATE["declared"]
    return declared is not None and not _same_device(t.device, declared)


def _same_device(d: torch.device, declared: torch.device) -> bool:
    if d.type != declared.type:
        return False
    return declared.index is None or d.index is None or d.index == declared.index


def _describe(t: torch.Tensor) -> str:
    where = "cpu (host)" if on_host(t) else str(_STATE["declared"])
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {where}"


def check_on_device(where: str, **tensors: torch.Tensor | None) -> None:
    """The hook for loss inputs (and any other device-only consumer): raise
    :class:`DeviceError` naming every tensor in ``tensors`` that is on the host. A no-op
    outside :func:`strict_devices` (cheap: the trainer may call it always). None is skipped.
    """
    if not strict_active():
        return
    bad = [f"{k}: {_describe(t)}" for k, t in tensors.items() if t is not None and on_host(t)]
    if bad:
        raise DeviceError(
            f"{where}: tensors on the host, but the compute device is "
            f"{_STATE['declared']} ({'; '.join(bad)})"
        )


# ---------------------------------------------------------------- collectives


def _checked(name: str, fn):
    def wrapper(*args, **kwargs):
        leaves, _ = tree_flatten((args, kwargs))
        for i, t in enumerate(x for x in leaves if isinstance(x, torch.Tensor)):
            if on_host(t):
                raise DeviceError(
                    f"torch.distributed.{name}: tensor #{i} {_describe(t)}; the compute device "
                    f"is {_STATE['declared']} (NCCL accepts CUDA tensors only: 'No backend "
                    "type associated with device type cpu')"
                )
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def _patched_collectives() -> Iterator[None]:
    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    try:
        for n, fn in saved.items():
            setattr(dist, n, _checked(n, fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


# ---------------------------------------------------------------- emulated compute device

_DEVICE_GET = torch.Tensor.device.__get__  # type: ignore[attr-defined]
_DATA_SET = torch.Tensor.data.__set__  # type: ignore[attr-defined]
_IS_CUDA_GET = torch.Tensor.is_cuda.__get__  # type: ignore[attr-defined]
_CROSSING = {
    torch.Tensor.copy_,
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.to,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
}
"""Ops that may take host and device tensors together (copies, indexing), as on CUDA."""


def _mode_active() -> bool:
    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[attr-defined]
    return any(isinstance(m, _EmulatedDevice) for m in stack)


def _target(dev: Any) -> str | None:
    """'device' / 'host' for a device argument, None when it is neither (meta, absent)."""
    if dev is None:
        return None
    if isinstance(dev, int) and not isinstance(dev, bool):
        return "device"
    d = torch.device(dev) if isinstance(dev, str) else dev
    if isinstance(d, torch.device):
        if d.type == "cuda":
            return "device"
        if d.type == "cpu":
            return "host"
    return None


def _mark(out: Any, host: bool, inputs: list[torch.Tensor]) -> Any:
    def one(t):
        if isinstance(t, torch.Tensor) and not any(t is i for i in inputs):
            if host:
                setattr(t, _HOST, True)
            elif getattr(t, _HOST, False):
                setattr(t, _HOST, False)
        return t

    return tree_map(one, out)


class _EmulatedDevice(TorchFunctionMode):
    """Tracks host vs device tensors on CPU (see the module docstring)."""

    def __init__(self, check_mixing: bool = True):
        super().__init__()
        self.check_mixing = check_mixing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == _DEVICE_GET:
            return torch.device("cpu") if getattr(args[0], _HOST, False) else _VIRTUAL
        if func == _IS_CUDA_GET:
            return not getattr(args[0], _HOST, False)
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if func == _DATA_SET:  # ``p.data = t`` moves p to t's placement (offload), as on CUDA
            out = func(*args, **kwargs)
            setattr(args[0], _HOST, bool(getattr(args[1], _HOST, False)))
            return out
        target = _target(kwargs.get("device"))
        if target == "device":
            kwargs["device"] = "cpu"
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        host_in = [t for t in tensors if getattr(t, _HOST, False)]
        dev_in = [t for t in tensors if not getattr(t, _HOST, False)]
        if (
            self.check_mixing
            and func not in _CROSSING
            and dev_in
            and any(t.dim() > 0 for t in host_in)
        ):
            raise DeviceError(
                f"{getattr(func, '__name__', func)}: expected all tensors to be on the same "
                f"device, but found at least two devices, {_VIRTUAL} and cpu (host tensor "
                f"{tuple(host_in[0].shape)})"
            )
        out = func(*args, **kwargs)
        if target is not None:
            host = target == "host"
        else:
            host = not dev_in and (bool(host_in) or not tensors)
        return _mark(out, host, tensors)

    @staticmethod
    def _move(func, args: tuple, kwargs: dict):
        """``.to`` / ``.cuda`` / ``.cpu``: physically a CPU no-op or dtype cast; a move across
        the emulated boundary returns a copy, tagged with its new placement."""
        src: torch.Tensor = args[0]
        rest = list(args[1:])
        if func is torch.Tensor.cuda:
            target, rest = "device", []
            kwargs = {k: v for k, v in kwargs.items() if k == "non_blocking"}
        elif func is torch.Tensor.cpu:
            target = "host"
        else:
            dev = kwargs.pop("device", None)
            if rest and isinstance(rest[0], torch.Tensor):  # .to(other): its placement, dtype
                other = rest.pop(0)
                dev = torch.device("cpu") if getattr(other, _HOST, False) else _VIRTUAL
                rest.insert(0, other.dtype)
            elif rest and not isinstance(rest[0], torch.dtype):  # .to(device[, dtype])
                dev = rest.pop(0)
            target = _target(dev)
            if target is None and dev is not None:
                kwargs["device"] = dev  # e.g. meta: a real move
        was_host = bool(getattr(src, _HOST, False))
        out = torch.Tensor.to(src, *rest, **kwargs) if rest or kwargs else src
        if target is None:  # dtype-only: same placement
            return _mark(out, was_host, [])
        if out is src and was_host != (target == "host"):
            out = src.clone()  # a real move copies
        return _mark(out, target == "host", [])


@contextlib.contextmanager
def _emulated(groups, check_mixing: bool) -> Iterator[torch.device]:
    import torch.cuda as tcuda

    saved_device = groups.device if groups is not None else None
    saved_current = tcuda.current_device
    mode = _EmulatedDevice(check_mixing)
    try:
        if groups is not None:
            groups.device = _VIRTUAL
        # Megatron allocates with device=torch.cuda.current_device(): the emulated device
        # inside the mode; outside it (the mode's own handler, backward) the CPU shim's.
        tcuda.current_device = lambda: 0 if _mode_active() else "cpu"  # type: ignore[assignment]
        with mode:
            yield _VIRTUAL
    finally:
        tcuda.current_device = saved_current  # type: ignore[assignment]
        if groups is not None:
            groups.device = saved_device


@contextlib.contextmanager
def _host_modules(modules) -> Iterator[None]:
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    try:
        for t in tensors:
            setattr(t, _HOST, True)
        yield
    finally:
        for t in tensors:
            setattr(t, _HOST, False)


@contextlib.contextmanager
def strict_devices(
    groups=None,
    *,
    device: torch.device | str | None = None,
    emulate: bool | None = None,
    check_mixing: bool = True,
    host_modules: tuple = (),
) -> Iterator[torch.device]:
    """Strict device mode for the block; yields the declared compute device.

    ``groups``: the run's ``ParallelGroups`` (its ``device`` is the declared one, and is
    switched to the emulated ``cuda:0`` for the block when emulating); or ``device``.
    ``emulate``: default True when the declared device is the CPU. ``check_mixing``: with
    emulation, also reject ops mixing host and device tensors (as CUDA does).
    ``host_modules``: with emulation, modules kept on the host (e.g. an in-process HF rollout
    engine's model: code that asks for CUDA-only objects, such as ``transformers``'
    ``generate`` making a generator on ``input.device``, cannot run on an emulated device).
    """
    if strict_active():
        raise RuntimeError("strict_devices is already active")
    declared = torch.device(device) if device is not None else getattr(groups, "device", None)
    if declared is None:
        raise ValueError("strict_devices needs groups or device")
    emulate = declared.type == "cpu" if emulate is None else emulate
    with contextlib.ExitStack() as stack:
        if emulate:
            declared = stack.enter_context(_emulated(groups, check_mixing))
            stack.enter_context(_host_modules(host_modules))
        _STATE.update(declared=declared, emulated=emulate)
        stack.callback(_STATE.update, declared=None, emulated=False)
        stack.enter_context(_patched_collectives())
        log.info(
            "strict device mode: compute device %s%s", declared, " (emulated)" if emulate else ""
        )
        yield declared


def strict_from_env(groups, host_modules: tuple = ()) -> contextlib.AbstractContextManager:
    """:func:`strict_devices` (``groups``, ``host_modules``) when ``MEGAGRPO_STRICT_DEVICES=1``,
    else a null context."""
    if os.environ.get(ENV, "") not in ("", "0"):
        return strict_devices(groups, host_modules=host_modules)
    return contextlib.nullcontext()
