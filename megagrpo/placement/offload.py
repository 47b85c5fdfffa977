"""Offload during generation (``trainer.offload_during_rollout``): the trainer's frozen weights
and the optimiser's moments live in (pinned) host memory while the engines sync and generate,
and on the compute device while the trainer computes.

Phase order of one step (what the 2-node memory plan assumes; ``megagrpo plan-memory``):

=====================  ========================  ===========  ======  ====================
phase                  call                      base weights moments LoRA parameters
=====================  ========================  ===========  ======  ====================
sync: trainer probe    (before the push)         device       device  device
sync: push             :meth:`for_sync`          host         host    device
generate / evaluate    :meth:`for_generation`    host         host    device
engines asleep, train  :meth:`for_training`      device       device  device
=====================  ========================  ===========  ======  ====================

The LoRA parameters never move: the adapter sync gathers them, and a merged sync streams the
base from the host (:meth:`megagrpo.model.policy.MegatronPolicy.merged_param` brings one
Megatron tensor at a time to the LoRA delta's device). At start-up the probe is computed
first, then the weights go to the host before the engines start (their memory budget at init
assumes it), and the first sync streams from there (:func:`megagrpo.trainer.sync.start_engines`).

Every call is idempotent and looks at where each tensor is now, so a skipped step, a restored
checkpoint (moments created on the device) or a repeated call moves only what is elsewhere.
On a GPU the host copies are pinned buffers allocated once and reused every step, the copies
are asynchronous and the allocator cache is emptied after offloading (vLLM allocates outside
PyTorch's cache). On a CPU run host and device are the same memory: nothing moves, unless
strict device mode emulates a separate device (:mod:`megagrpo.parallel.strict`), where the
copies are real and every tensor's placement observable (the offload test records it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megagrpo.parallel.strict import on_host, strict_active

log = logging.getLogger(__name__)

HOST, DEVICE = "host", "device"


class Offload:
    """Moves ``policy``'s frozen parameters and ``optimizer``'s per-parameter state tensors
    between the compute device (``device_of()``, read at every call: strict mode swaps it)
    and host memory. Disabled (``enabled=False``): every call is a no-op."""

    def __init__(self, policy: Any, optimizer: torch.optim.Optimizer, device_of, enabled: bool):
        self.policy, self.optimizer, self.enabled = policy, optimizer, enabled
        self._device_of = device_of
        self._pinned: dict[tuple, torch.Tensor] = {}
        self.seconds = 0.0
        """Wall time spent moving (since :meth:`pop_metrics`)."""
        self.bytes = 0
        """Bytes moved either way (since :meth:`pop_metrics`)."""

    # ------------------------------------------------------------------ what moves
    def frozen(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` of every frozen parameter of the policy (its base weights);
        none for a policy that is not an ``nn.Module``."""
        if not isinstance(self.policy, nn.Module):
            return []
        return [(n, p) for n, p in self.policy.named_parameters() if not p.requires_grad]

    def trainable(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` of the trainable (LoRA) parameters (they never move)."""
        if not isinstance(self.policy, nn.Module):
            return [(f"param{i}", p) for i, p in enumerate(self.policy.lora_parameters())]
        return [(n, p) for n, p in self.policy.named_parameters() if p.requires_grad]

    def moments(self) -> Iterator[tuple[str, dict, str, torch.Tensor]]:
        """``(name, state dict, key, tensor)`` of every optimiser state tensor with elements
        (AdamW's ``exp_avg`` / ``exp_avg_sq``; the 0-dim ``step`` stays where torch keeps it)."""
        index = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        yield f"optimizer.{index}.{key}", state, key, value
                index += 1

    # ------------------------------------------------------------------ placement
    def _device(self) -> torch.device:
        return torch.device(self._device_of())

    def where(self, t: torch.Tensor) -> str:
        """``host`` or ``device`` for ``t`` (the emulated placement under strict mode)."""
        if strict_active():
            return HOST if on_host(t) else DEVICE
        dev = self._device()
        same = t.device.type == dev.type and (dev.index is None or t.device.index == dev.index)
        return DEVICE if same else HOST

    def placement(self) -> dict[str, str]:
        """Where every frozen weight, LoRA parameter and optimiser state tensor is now:
        ``{"weights.<name>" | "lora.<name>" | "optimizer.<i>.<key>": "host" | "device"}``."""
        out = {f"weights.{n}": self.where(p) for n, p in self.frozen()}
        out.update({f"lora.{n}": self.where(p) for n, p in self.trainable()})
        out.update({name: self.where(t) for name, _, _, t in self.moments()})
        return out

    def _separate(self) -> bool:
        """True when host and device are different memories (GPU, or emulated in strict
        mode); on a plain CPU run there is nothing to move."""
        return self._device().type != "cpu"

    # ------------------------------------------------------------------ moves
    def _to_host(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_available():
            buf = self._pinned.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                self._pinned[key] = buf
            buf.copy_(t, non_blocking=True)
        else:  # the strict-mode emulation: a tagged host copy
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            buf.copy_(t)
        return buf

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t, device=self._device())
        out.copy_(t, non_blocking=True)
        return out

    def _move(self, weights: bool, moments: bool, target: str) -> None:
        if not self.enabled or not self._separate():
            return
        t0, moved = time.perf_counter(), 0
        with torch.no_grad():
            if weights:
                for name, p in self.frozen():
                    if self.where(p) != target:
                        p.data = (
                            self._to_host(("w", name), p.data)
                            if target == HOST
                            else self._to_device(p.data)
                        )
                        moved += p.numel() * p.element_size()
            if moments:
                for name, state, key, t in list(self.moments()):
                    if self.where(t) != target:
                        state[key] = (
                            self._to_host(("m", name), t) if target == HOST else self._to_device(t)
                        )
                        moved += t.numel() * t.element_size()
        if torch.cuda.is_available() and moved:
            torch.cuda.synchronize()
            if target == HOST:
                torch.cuda.empty_cache()  # give the memory back for the engine's allocator
        self.seconds += time.perf_counter() - t0
        self.bytes += moved
        if moved:
            log.debug("offload: %.1f MB to the %s", moved / 1e6, target)

    # ------------------------------------------------------------------ phases
    def for_sync(self) -> None:
        """Before the push into the engines (after the trainer's probe): base weights and
        moments to the host; the LoRA parameters stay."""
        self._move(weights=True, moments=True, target=HOST)

    def for_generation(self) -> None:
        """While the engines generate (and evaluate): everything but the LoRA parameters on
        the host."""
        self._move(weights=True, moments=True, target=HOST)

    def for_training(self) -> None:
        """The engines are asleep: everything back on the device for forward/backward and the
        optimiser step (and the next sync's probe)."""
        self._move(weights=True, moments=True, target=DEVICE)

    def pop_metrics(self) -> dict[str, float]:
        """``perf/offload_s`` and ``perf/offload_gb`` since the last call (empty when off)."""
        if not self.enabled:
            return {}
        out = {"perf/offload_s": self.seconds, "perf/offload_gb": self.bytes / 1e9}
        self.seconds, self.bytes = 0.0, 0
        return out
