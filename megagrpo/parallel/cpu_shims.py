"""CPU/gloo compatibility for megatron-core 0.16.1: the one place where Megatron is patched.

megatron-core assumes CUDA (devices, RNG tracker, streams) and NCCL (uneven all-gather) in a
handful of places. :func:`apply_cpu_shims` replaces exactly those, and only when CUDA is not
available; on a GPU machine it is a no-op and Megatron runs unmodified. Each shim below says
what it replaces and why. Applying twice is harmless (idempotent). The pipeline schedule's
shim is scoped to each schedule call instead (:func:`pipeline_schedule_compat`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)
_APPLIED = False


class _CpuRNGStatesTracker:
    """Stands in for ``tensor_parallel.random.CudaRNGStatesTracker`` on CPU.

    Megatron forks named RNG states (model-parallel, data-parallel, expert-parallel) around
    dropout and weight init; the original stores ``torch.cuda`` generator states. Here the
    states are CPU generator states, with the same ``add / fork / get_states / set_states``
    interface, so dropout under TP gets per-rank streams exactly as on GPU.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator().manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _NoStream:
    """Placeholder for the dispatcher's class-level ``torch.cuda.Stream()``."""


def _patch_devices() -> None:
    # Megatron allocates buffers with ``device=torch.cuda.current_device()`` (mappings,
    # embeddings, MoE utils). Without CUDA that call raises; answering "cpu" keeps every such
    # allocation on the host.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _patch_rng() -> None:
    # ``model_parallel_cuda_manual_seed`` and the tracker use torch.cuda generator states.
    # Install the CPU tracker (same interface) and seed it the way Megatron would.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def _seed(seed: int, *args, **kwargs) -> None:
        from megatron.core import parallel_state as ps

        tracker = _CpuRNGStatesTracker()
        tp_rank = ps.get_tensor_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
        etp_rank = int(ps.get_expert_tensor_parallel_rank() or 0)
        torch.manual_seed(seed)
        tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
        tracker.add(
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank
        )
        mrandom._CUDA_RNG_STATE_TRACKER = tracker
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.model_parallel_cuda_manual_seed = _seed
    import megatron.core.tensor_parallel as tp_pkg

    tp_pkg.model_parallel_cuda_manual_seed = _seed


def _patch_checkpoint_rng() -> None:
    # Activation recompute (``tensor_parallel.checkpoint``) saves the CPU generator state, the
    # CUDA default generator's state and the tracker's states before a block's forward and
    # restores them before recomputing it, so dropout masks repeat. Without CUDA there is no
    # CUDA generator: get/set of its state become no-ops. The CPU state (which CPU dropout,
    # LoRA's included, draws from) and the CPU tracker's states are still saved and restored.
    from megatron.core.tensor_parallel import random as mrandom

    def _get_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def _set_cuda_rng_state(*args, **kwargs) -> None:
        return None

    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state


def _patch_causal_mask() -> None:
    # ``transformer.utils.get_default_causal_mask`` builds the causal mask with device="cuda";
    # the local-spec softmax (fused_softmax imports it by name) calls it for every attention.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        # on "the" device, as Megatron's device="cuda": current_device() is cpu here, the
        # emulated device under megagrpo.parallel.strict
        dev = torch.cuda.current_device()
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=dev), diagonal=1)

    tutils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_router_gemm() -> None:
    # The router's fp32 GEMM uses Transformer Engine's ``general_gemm`` when importable; a
    # partial TE install would crash on CPU. ``None`` selects the plain torch matmul path.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _patch_alltoall_dispatcher() -> None:
    # MoEAlltoAllTokenDispatcher creates a class-level ``torch.cuda.Stream()`` in __init__
    # and moves split sizes to the host on that side stream with a recorded event. On CPU
    # there are no streams: pre-set the stream and do the host copies synchronously.
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    # The original turns split sizes into numpy only for CUDA tensors (CPU tensors stay
    # tensors, which gloo's all_to_all_single rejects as split sizes): convert here.
    dispatcher: Any = td.MoEAlltoAllTokenDispatcher  # patched class attributes
    dispatcher.cuda_dtoh_stream = _NoStream()

    def host(t, as_numpy=False):
        t = maybe_move_tensor_to_cpu(t)
        return t.numpy() if as_numpy and torch.is_tensor(t) else t

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            tokens_per_expert = host(tokens_per_expert)
            self.input_splits = host(self.input_splits, as_numpy=True)
            self.output_splits = host(self.output_splits, as_numpy=True)
            self.output_splits_tp = host(self.output_splits_tp, as_numpy=True)
            self.num_out_tokens = host(self.num_out_tokens)
            if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = host(
                    self.num_global_tokens_per_local_expert
                )
        return tokens_per_expert

    dispatcher._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize


def _patch_torch_norm() -> None:
    # The local spec's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel`` (the
    # assert guards TE-only fusions). A torch RMSNorm is correct under SP: it is per token.
    # Mark its weight ``sequence_parallel`` as TE does, so grads are summed over TP.
    from megatron.core.transformer import torch_norm

    def __new__(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r} unsupported on CPU")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_uneven_all_gather() -> None:
    # gloo has no uneven ``all_gather`` (list of differently sized outputs), which the MoE
    # dispatcher uses under TP>1 (``output_split_sizes``). Pad every rank's chunk to the
    # largest, gather evenly with ``all_gather_into_tensor``, then cut the padding away.
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        world = group.size()
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((longest * world, *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
        chunks = [out[i * longest : i * longest + n] for i, n in enumerate(output_split_sizes)]
        return torch.cat(chunks, dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim


class _CudaToCpu(TorchFunctionMode):
    """Tensor factories asked for ``device="cuda"`` allocate on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def pipeline_schedule_compat() -> Iterator[None]:
    """The pipeline schedule's shim, for the duration of one schedule call (a no-op with CUDA).

    megatron-core 0.16.1's ``pipeline_parallel/schedules.py`` calls
    ``torch.cuda.synchronize()`` around the p2p shape exchange and allocates its token counter
    with ``torch.zeros([], dtype=torch.int, device="cuda")`` (lines 596, 983, 2138). Without
    CUDA the first becomes a no-op and ``device="cuda"`` factories allocate on the CPU inside
    the block; under strict device mode (:mod:`megagrpo.parallel.strict`: emulated CUDA on
    CPU) the emulation already maps ``device="cuda"``, so only the synchronize is patched.
    Scoped rather than applied once: a global ``device="cuda"`` rewrite would hide real
    device bugs everywhere else.
    """
    if torch.cuda.is_available():
        yield
        return
    from megagrpo.parallel.strict import strict_active

    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    try:
        with contextlib.nullcontext() if strict_active() else _CudaToCpu():
            yield
    finally:
        torch.cuda.synchronize = original


def apply_cpu_shims(force: bool = False) -> bool:
    """Patch megatron-core for CPU/gloo if CUDA is unavailable (or ``force``).

    Returns True when the shims are (already) applied. Call before building any model.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    _patch_devices()
    _patch_rng()
    _patch_checkpoint_rng()
    _patch_causal_mask()
    _patch_router_gemm()
    _patch_alltoall_dispatcher()
    _patch_torch_norm()
    _patch_uneven_all_gather()
    _APPLIED = True
    log.debug("megatron-core CPU/gloo shims applied")
    return True
