"""vLLM's in-place reload from megagrpo's side: the checkpoint names its loaders map, and what
it reports it did not load.

**Names (B1).** A merged sync streams HF checkpoint names (``...experts.{e}.gate_proj.weight``)
into ``collective_rpc("reload_weights", is_checkpoint_format=True)``. Once vLLM serves LoRA,
``FusedMoEWithLoRA`` sets ``routed_experts.lora_base_layer_prefix = "base_layer."`` (vLLM 0.33
``lora/layers/fused_moe.py``), and ``RoutedExperts.get_expert_mapping`` -- the table its
``load_weights`` matches names against -- then expects
``experts.{e}.gate_proj.base_layer.weight`` (``build_expert_params_mapping``: the names of a
checkpoint saved from a LoRA-wrapped model; vLLM PRs 31104 / 37114 / 52552, which verl's
weight sync follows). Plain names then match nothing, the layerwise reload puts the old
(dummy) experts back and raises nothing. :func:`expert_infixes` reads, per MoE layer, the infix
that layer's own mapping expects (in the vLLM worker, ``apply_model``), and
:func:`checkpoint_names` rewrites the stream to it: ``""`` without LoRA (no change), so an
upstream that drops the prefix needs nothing here. Clearing the prefix around the reload would
work too, but it mutates vLLM's layer state (also read by EPLB's expert substitution) across a
call that can fail midway; sending the names the loader asks for changes nothing in vLLM.

**What was not loaded (W1).** vLLM reports a reload that skipped tensors only in its log: the
layerwise reload's ``"<Layer>: Failed to load weights"`` (every layer with loadable tensors
that received none: its old tensors are put back) and ``"Following weights were not loaded
from checkpoint: {...}"`` (unquantized models; parameter names). :class:`ReloadWatch` collects
both while a reload runs; :meth:`ReloadWatch.problems` keeps what a sync must not tolerate --
every parameter name, every layer class that holds parameters -- and drops the two expected
messages: layers without parameters (``RotaryEmbedding``: buffers only, never streamed) and
the tied LM head (it shares the embedding, whose load fills it). The engine raises
WeightSyncError naming them.

Read against vLLM 0.33.0 (``model_executor/model_loader/reload/{inplace,layerwise}.py``,
``model_executor/layers/fused_moe/routed_experts.py``); tests/contract runs it there.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
"""Where vLLM 0.33 reports what a reload did not load."""
_FAILED_LAYER = re.compile(r"^(\w+): Failed to load weights$")
_NOT_LOADED = "Following weights were not loaded from checkpoint"
_EXPERT_HF = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_MAPPED = re.compile(r"^experts\.\d+\.(?:gate|up|down)_proj\.(.*)$")
TIED_HEAD = "ParallelLMHead"


def expert_infixes(model: torch.nn.Module) -> dict[str, str]:
    """Runs in a vLLM worker (``apply_model``): per MoE layer (HF prefix
    ``model.layers.{i}.mlp.experts``), the infix its loader expects between
    ``experts.{e}.{proj}.`` and ``weight`` (``"base_layer."`` under LoRA, else ``""``), read
    from the layer's own ``get_expert_mapping()``."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        mapping: Any = getattr(module, "get_expert_mapping", None)
        if not callable(mapping) or "w13_weight" not in module._parameters:
            continue
        infix = None
        table: list[Any] = list(cast(Any, mapping)())  # (param, weight name, expert, shard)
        for _param, weight_name, _expert, _shard in table:
            m = _MAPPED.match(weight_name)
            if m is not None:
                infix = m.group(1)
                break
        if infix is None:
            infix = str(getattr(module, "lora_base_layer_prefix", "") or "")
        prefix = name.replace(".base_layer", "")
        if ".experts" in prefix:
            prefix = prefix[: prefix.index(".experts") + len(".experts")]
        out[prefix] = infix
    return out


def checkpoint_names(
    stream: Iterable[tuple[str, torch.Tensor]], infixes: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` with per-expert HF names rewritten to what each layer's loader maps
    (:func:`expert_infixes`); every other name unchanged."""
    if not any(infixes.values()):
        yield from stream
        return
    for name, tensor in stream:
        m = _EXPERT_HF.match(name)
        infix = infixes.get(m.group(1), "") if m else ""
        if m and infix:
            prefix, e, kind = m.groups()
            name = f"{prefix}.{e}.{kind}_proj.{infix}weight"
        yield name, tensor


def buffer_only_layers(model: torch.nn.Module) -> list[str]:
    """Runs in a vLLM worker: the classes of modules with buffers but no parameters (their
    "Failed to load weights" is expected: nothing of theirs is in a checkpoint)."""
    holders = {type(m).__name__ for m in model.modules() if any(True for _ in m.parameters(False))}
    return sorted(
        {type(m).__name__ for m in model.modules() if any(True for _ in m.buffers(False))} - holders
    )


class ReloadWatch(logging.Filter):
    """While :meth:`watching`: collects vLLM's not-loaded reports (module docstring).

    A filter on the :data:`RELOAD_LOGGERS` (before their handlers): it records every report,
    drops the expected ones from the console, and shows the rest at the configured level."""

    def __init__(self) -> None:
        super().__init__("megagrpo.vllm_reload")
        self.active = False
        self.failed_layers: list[str] = []
        self.not_loaded: set[str] = set()
        self.expected: set[str] = set()
        self.show_level = logging.WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.active:
            return True
        msg = record.getMessage()
        m = _FAILED_LAYER.match(msg)
        if m is not None:
            self.failed_layers.append(m.group(1))
            if m.group(1) in self.expected:
                return False
        elif msg.startswith(_NOT_LOADED):
            names = record.args[0] if isinstance(record.args, tuple) and record.args else None
            if isinstance(names, (set, frozenset, list, tuple)):
                self.not_loaded.update(str(n) for n in names)
            else:
                self.not_loaded.add(msg.split(":", 1)[-1].strip())
        return record.levelno >= self.show_level

    @contextlib.contextmanager
    def watching(self, expected: Iterable[str], show_level: str = "WARNING") -> Iterator[None]:
        """Collect during the ``with`` block (cleared on entry); ``expected``: layer classes
        whose "Failed to load weights" is dropped (:func:`expected_failures`)."""
        self.failed_layers, self.not_loaded = [], set()
        self.expected = set(expected)
        self.show_level = logging.getLevelName(show_level.upper())
        if not isinstance(self.show_level, int):
            self.show_level = logging.WARNING
        saved = []
        for name in RELOAD_LOGGERS:  # the reports are warnings: create them at any level
            logger = logging.getLogger(name)
            saved.append((logger, logger.level))
            if logger.getEffectiveLevel() > logging.WARNING:
                logger.setLevel(logging.WARNING)
            if self not in logger.filters:
                logger.filters.insert(0, self)  # before megagrpo's noise filter
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for logger, level in saved:
                logger.setLevel(level)

    def problems(self) -> tuple[list[str], list[str]]:
        """``(layer classes, parameter names)`` that vLLM says it did not load, expected
        ones excluded."""
        layers = sorted({c for c in self.failed_layers if c not in self.expected})
        return layers, sorted(self.not_loaded)


def expected_failures(buffer_only: Iterable[str], tied: bool) -> set[str]:
    """Layer classes whose "Failed to load weights" is expected on every reload: those
    without parameters (:func:`buffer_only_layers`), and the tied LM head."""
    return set(buffer_only) | ({TIED_HEAD} if tied else set())


def reload_error(layers: list[str], params: list[str]) -> str:
    """The WeightSyncError message of a reload vLLM reports incomplete."""
    return (
        f"vLLM loaded no weights into {layers or 'some layers'} and reports {len(params)} "
        f"parameters not loaded (first: {params[:3]}): they keep their previous values (a "
        "dummy start's random ones); the streamed names do not match what those layers' "
        "loaders map. Do not raise rollout.verify_tol: the engine would sample from them."
    )


WATCH = ReloadWatch()
"""The process's watch (vLLM's worker runs in the training process)."""
