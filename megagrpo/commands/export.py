"""`megagrpo export RUN_DIR [--step N] (--adapter | --merged) --out DIR`: a training checkpoint
as a PEFT adapter or a merged HF model.

Any checkpoint with layout-free LoRA pieces (:mod:`megagrpo.model.lora_state`; every
checkpoint of the Megatron policy) converts in one process, whatever TP / EP / PP / world
size wrote it, without building a model: the pieces of every rank file are assembled into the
PEFT view of the adapters (``A [r, in]``, ``B [out, r]`` per HF weight) and

- ``--adapter``: written as ``adapter_config.json`` + ``adapter_model.safetensors``.
  ``--format peft`` (default): peft's layout, which peft loads onto the transformers model
  (MoE experts fused: ``target_parameters`` on ``mlp.experts.gate_up_proj`` / ``down_proj``).
  ``--format vllm``: exactly what megagrpo's engines receive at every adapter sync (the
  engine's ``peft_state``: per-expert keys ``mlp.experts.{e}.{gate,up,down}_proj``, fp32),
  which ``vllm serve --enable-lora`` loads for Qwen3-MoE (its 2D MoE LoRA layer; a fused
  adapter is refused there) and ``megagrpo eval --adapter`` serves;
- ``--merged``: folded into the base weights (``W + alpha/r * B A`` in fp32, cast to the
  checkpoint's dtype, as a merged weight sync does) and written as safetensors shards next to
  the base model's config and tokenizer: a model transformers / vLLM load directly.

The checkpoint's files are checked against its manifest (size, SHA-256) first; the base
model is the run's ``model.hf_path`` unless ``--model`` names another copy of it, and its
weights must be those the LoRA was trained on (the fingerprint in the checkpoint's manifest;
``--allow-base-change`` to combine them anyway). ``--merged`` copies the base's config and
tokenizer files, never its weights in another format (``.bin``, ``.pt``, ``.gguf`` and
their indexes). Output is written to a temporary directory and renamed when complete;
``--out`` must be new or empty and apart from the run and model directories, and still new
or empty at the rename (what appeared there meanwhile is kept, and so is the finished
output, in a temporary directory the error names): export never deletes. A full disk is
named (file, free space) with nothing left in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from megagrpo import fileio
from megagrpo.errors import CheckpointError, ConfigError, StorageError

DESCRIPTION = __doc__
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory (runs/<trainer.name>)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--adapter", action="store_true", help="write a PEFT adapter")
    what.add_argument("--merged", action="store_true", help="write a merged HF model")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--format",
        dest="adapter_format",
        default=None,
        choices=("peft", "vllm"),
        help="--adapter layout: peft (default; peft's fused MoE experts) | vllm (what the "
        "engines receive: per-expert keys, loadable by `vllm serve --enable-lora`)",
    )
    parser.add_argument(  # the name before --format (fused = peft, per_expert = vllm)
        "--expert-format", choices=("fused", "per_expert"), default=None, help=argparse.SUPPRESS
    )
    parser.add_argument("--model", default=None, help="base model directory (default: the run's)")
    parser.add_argument(
        "--allow-base-change",
        action="store_true",
        help="combine the LoRA with base weights other than those it was trained on (their "
        "fingerprint differs from the checkpoint's); refused otherwise",
    )


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """``RUN_DIR/checkpoints/step_N`` (the newest complete one without ``step``);
    ConfigError naming what exists when there is none."""
    from megagrpo.checkpoint.format import complete_checkpoints, step_dir

    root = Path(run_dir) / "checkpoints"
    done = complete_checkpoints(root)
    if step is None:
        if not done:
            raise ConfigError(f"{run_dir}: no complete checkpoint under {root}")
        return done[-1][1]
    path = step_dir(root, step)
    if not any(s == step for s, _ in done):
        have = [p.name for _, p in done]
        raise ConfigError(f"--step {step}: no complete checkpoint {path} (have: {have or 'none'})")
    return path


def read_checkpoint(ckpt: Path) -> tuple[dict[str, Any], list[dict]]:
    """``(manifest, pieces of every rank)`` of a verified layout-free checkpoint."""
    from megagrpo.checkpoint.format import check_files, load_resharded, read_manifest, reshardable

    manifest = read_manifest(ckpt)
    bad = check_files(ckpt, manifest)
    if bad:
        raise CheckpointError(f"{ckpt}: damaged checkpoint ({'; '.join(bad)})")
    if not reshardable(manifest):
        raise CheckpointError(
            f"{ckpt}: its LoRA state is in per-rank shards (written by an older megagrpo or a "
            "policy without layout-free pieces); resume the run under its own layout and let "
            "it write a new checkpoint, then export that"
        )
    states, _ = load_resharded(ckpt, rank=0, meta={})  # weights-only, memory-mapped
    return manifest, [p for state in states for p in state["pieces"]]


def _model_and_lora(manifest: dict, model: str | None) -> tuple[Path, Any, Any]:
    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.config import LoraConfig
    from megagrpo.model.pretrained import resolve_model_path

    cfg = manifest.get("config") or {}
    hf_path = model or (cfg.get("model") or {}).get("hf_path") or manifest.get("model")
    if not hf_path:
        raise ConfigError("the checkpoint names no base model: pass --model DIR")
    if "${" in str(hf_path):  # written as an environment interpolation: resolve it here
        from omegaconf import OmegaConf

        try:
            hf_path = OmegaConf.create({"v": hf_path}).v
        except Exception as exc:  # noqa: BLE001 - omegaconf raises several types
            raise ConfigError(f"model.hf_path {hf_path!r}: {exc}; pass --model DIR") from exc
    model_dir = Path(resolve_model_path(str(hf_path), need_tokenizer=False))
    lora = LoraConfig(**(cfg.get("model") or {}).get("lora", manifest.get("lora") or {}))
    return model_dir, arch_from_hf(load_hf_config(model_dir)), lora


def check_base(ckpt: Path, manifest: dict, model_dir: Path, allow_change: bool = False) -> None:
    """The base weights in ``model_dir`` must be those the checkpoint's LoRA was trained on
    (the fingerprint in its manifest): CheckpointError naming both, unless ``allow_change``
    (then a warning); a checkpoint without a fingerprint (older megagrpo) passes with a
    warning."""
    from megagrpo.model.fingerprint import changed

    saved = manifest.get("base")
    if not isinstance(saved, dict):
        log.warning(
            "%s was written without a fingerprint of the base weights: whether %s holds the "
            "weights its LoRA was trained on cannot be checked",
            ckpt,
            model_dir,
        )
        return
    diff = changed(saved, model_dir)
    if diff is None:
        return
    what = (
        f"the base weights in {model_dir} are not those {ckpt.name}'s LoRA was trained on ({diff})"
    )
    if allow_change:
        log.warning("--allow-base-change: %s; combining them anyway", what)
        return
    raise CheckpointError(
        f"{what}: pass --model DIR with the weights the run trained on, or "
        "--allow-base-change to combine the LoRA with these"
    )


def check_out(out: str | Path, ckpt: Path, model_dir: Path | None = None) -> None:
    """Refuse an ``--out`` that exists and is not empty, or that is, contains or lies inside
    the run directory of ``ckpt`` or the base model directory: export writes, never deletes."""
    from megagrpo import fileio

    protected: dict[str, Path] = {"run directory": ckpt.parent.parent}
    if model_dir is not None:
        protected["base model directory"] = model_dir
    fileio.check_out_dir(out, protected)


FORMATS = {"peft": "fused", "vllm": "per_expert", "fused": "fused", "per_expert": "per_expert"}
"""``--format`` (and the older ``--expert-format`` values) -> the expert layout."""


def export_adapter(
    ckpt: Path,
    out: str | Path,
    fmt: str = "peft",
    model: str | None = None,
    allow_base_change: bool = False,
) -> Path:
    """The adapter of checkpoint ``ckpt`` in ``out`` in format ``fmt`` (peft | vllm; see the
    module docstring), after :func:`check_base`."""
    from megagrpo import fileio
    from megagrpo.model.lora_state import lora_units
    from megagrpo.model.peft_export import check_exportable, write_peft_dir
    from megagrpo.rollout.lora import PeftAdapter, write_peft_adapter

    layout = FORMATS[fmt]
    manifest, pieces = read_checkpoint(ckpt)
    model_dir, arch, lora = _model_and_lora(manifest, model)
    check_out(out, ckpt, model_dir)
    check_base(ckpt, manifest, model_dir, allow_base_change)
    check_exportable(lora, arch.is_moe, layout)
    units = lora_units(pieces, arch, lora)
    if layout == "fused":
        return write_peft_dir(units, lora, arch.num_experts, out, str(model_dir), layout)
    adapter = PeftAdapter(rank=lora.rank, alpha=lora.alpha)  # the engines' view of it
    for name, (a, b) in units.items():
        adapter.a[name.removesuffix(".weight")] = a
        adapter.b[name.removesuffix(".weight")] = b
    with fileio.atomic_dir(Path(out), unique=True) as tmp:
        write_peft_adapter(adapter, tmp)
    return Path(out)


def export_merged(
    ckpt: Path, out: str | Path, model: str | None = None, allow_base_change: bool = False
) -> Path:
    """Base weights + the checkpoint's adapters merged, as an HF model directory in ``out``:
    one output shard per base shard, the index, config and tokenizer files (after
    :func:`check_base`)."""
    import torch
    from safetensors.torch import save_file

    from megagrpo import fileio
    from megagrpo.model.lora_state import lora_units
    from megagrpo.model.megatron_ckpt import copy_hf_metadata
    from megagrpo.model.merge_precision import merge_delta
    from megagrpo.model.weights import open_safetensors, safetensors_files

    manifest, pieces = read_checkpoint(ckpt)
    model_dir, arch, lora = _model_and_lora(manifest, model)
    check_out(out, ckpt, model_dir)
    check_base(ckpt, manifest, model_dir, allow_base_change)
    units = lora_units(pieces, arch, lora)
    scale = lora.alpha / lora.rank
    index: dict[str, str] = {}
    total, merged = 0, 0
    with fileio.atomic_dir(Path(out), unique=True) as tmp:
        copy_hf_metadata(model_dir, tmp)
        for i, src in enumerate(safetensors_files(model_dir)):
            tensors = {}
            with open_safetensors(src) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    w = f.get_tensor(name)
                    if name in units:
                        a, b = units[name]
                        w = merge_delta(
                            w, torch.matmul(b.float(), a.float()) * scale
                        )  # as the sync
                        merged += 1
                    tensors[name] = w.contiguous()
                    total += w.numel() * w.element_size()
            fname = f"model-{i + 1:05d}.safetensors"
            fileio.library_write(
                tmp / fname, lambda p, t=tensors: save_file(t, p, metadata={"format": "pt"})
            )
            index.update(dict.fromkeys(tensors, fname))
        if merged != len(units):  # before the rename: --out never holds a model missing them
            missing = sorted(set(units) - set(index))
            raise CheckpointError(
                f"{model_dir}: {len(missing)} adapted weights not found in the base model "
                f"(e.g. {missing[0]}); nothing written to {out}"
            )
        body = {"metadata": {"total_size": total}, "weight_map": index}
        fileio.write_text(tmp / "model.safetensors.index.json", json.dumps(body, indent=1))
    return Path(out)


def run(args: argparse.Namespace) -> int:
    ckpt = find_checkpoint(args.run_dir, args.step)
    check_out(args.out, ckpt)  # before reading anything (the model is checked once resolved)
    allow = args.allow_base_change
    try:
        if args.adapter:
            fmt = args.adapter_format or args.expert_format or "peft"
            out = export_adapter(ckpt, args.out, fmt, args.model, allow)
        else:
            out = export_merged(ckpt, args.out, args.model, allow)
    except OSError as exc:  # disk full, a read-only file system: named, nothing in --out
        where = exc.filename or args.out
        raise StorageError(
            f"{fileio.describe_os_error(exc, where)}; nothing was written to {args.out}"
        ) from exc
    print(f"{'adapter' if args.adapter else 'merged model'} of {ckpt.name} -> {out}")
    return 0
