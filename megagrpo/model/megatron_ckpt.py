"""The converter's Megatron checkpoint format (``tools/convert_ckpt.py``): per-rank safetensors
shards + metadata; HF ⇄ Megatron. Not the training checkpoints of a run
(:mod:`megagrpo.checkpoint.format`).

Layout of a checkpoint directory::

    megagrpo_ckpt.json           format, parallel layout, world size, LoRA config
    hf/                          config.json + tokenizer files of the source HF model
    dense_tp{t}_pp{p}.safetensors        non-expert shards (written by DP rank 0)
    expert_ep{e}_etp{t}_pp{p}.safetensors  expert shards (written by expert-DP rank 0)
    lora_*.safetensors           the same split for LoRA shards (when present)

A checkpoint is reloaded under the layout it was written with. Everything is written into a
temporary sibling directory and renamed into place when every rank has finished.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo import fileio
from megagrpo.errors import CheckpointError
from megagrpo.model.arch import arch_from_hf, load_hf_config
from megagrpo.model.config import LoraConfig, ModelConfig
from megagrpo.model.hf_mapping import hf_weight_shapes
from megagrpo.model.weights import load_safetensors, open_safetensors, safetensors_files
from megagrpo.parallel.config import ParallelConfig

log = logging.getLogger(__name__)
FORMAT = "megagrpo-megatron-v1"
META = "megagrpo_ckpt.json"


def check_hf_dir(hf_dir: str | Path) -> dict:
    """Validate an HF checkpoint from the safetensors headers only (no tensor data read):
    every expected tensor present with the right shape, nothing unknown. Returns config."""
    cfg = load_hf_config(hf_dir)
    arch = arch_from_hf(cfg)
    shapes, seen = hf_weight_shapes(arch), set()
    for path in safetensors_files(hf_dir):
        with open_safetensors(path) as f:
            for key in f.keys():
                if key == "lm_head.weight" and arch.tie_word_embeddings:
                    continue
                if key not in shapes:
                    raise CheckpointError(f"{path.name}: unknown tensor '{key}'")
                shape = tuple(f.get_slice(key).get_shape())
                if shape != shapes[key]:
                    raise CheckpointError(
                        f"{path.name}: tensor '{key}' has shape {shape}, "
                        f"config implies {shapes[key]}"
                    )
                seen.add(key)
    missing = [k for k in shapes if k not in seen]
    if missing:
        raise CheckpointError(
            f"{hf_dir}: tensor '{missing[0]}' missing ({len(missing)} missing in total)"
        )
    return cfg


def _shard_names(groups, prefix: str = "") -> tuple[str, str]:
    g = groups
    return (
        f"{prefix}dense_tp{g.tp_rank}_pp{g.pp_rank}.safetensors",
        f"{prefix}expert_ep{g.ep_rank}_etp{g.etp_rank}_pp{g.pp_rank}.safetensors",
    )


def _split(sd: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    dense = {k: v.contiguous() for k, v in sd.items() if ".mlp.experts." not in k}
    expert = {k: v.contiguous() for k, v in sd.items() if ".mlp.experts." in k}
    return dense, expert


def save_shards(policy, out_dir: Path, with_lora: bool) -> None:
    """Write this rank's base (and LoRA) shards; replicas over DP do not write."""
    from safetensors.torch import save_file

    g = policy.groups
    base = {n: p.detach() for n, p in policy.model.named_parameters() if ".adapter." not in n}
    parts = [("", base)] + ([("lora_", policy.lora_state_dict())] if with_lora else [])
    for prefix, sd in parts:
        dense, expert = _split(sd)
        dname, ename = _shard_names(g, prefix)
        if g.dp_rank == 0 and dense:
            save_file(dense, str(out_dir / dname))
        if g.expert_dp_rank == 0 and expert:
            save_file(expert, str(out_dir / ename))


def load_lora_shards(policy, ckpt: Path) -> None:
    """Load this rank's LoRA shards from ``ckpt``."""
    sd: dict[str, torch.Tensor] = {}
    for name in _shard_names(policy.groups, "lora_"):
        if (ckpt / name).is_file():
            sd.update(load_safetensors(ckpt / name))
    policy.load_lora_state_dict(sd)


def load_shards(policy, ckpt: Path, with_lora: bool) -> None:
    """Load this rank's shards written by :func:`save_shards` (same layout)."""
    params = {n: p for n, p in policy.model.named_parameters() if ".adapter." not in n}
    for prefix in ("",) + (("lora_",) if with_lora else ()):
        sd: dict[str, torch.Tensor] = {}
        for name in _shard_names(policy.groups, prefix):
            path = ckpt / name
            if not path.is_file():
                if any(".mlp.experts." in k for k in params) or "dense" in name:
                    raise CheckpointError(f"{ckpt}: shard file '{name}' missing")
                continue
            sd.update(load_safetensors(path))
        if prefix:
            policy.load_lora_state_dict(sd)
            continue
        missing = sorted(set(params) - set(sd))
        if missing:
            raise CheckpointError(f"{ckpt}: tensor '{missing[0]}' missing from the shards")
        with torch.no_grad():
            for n, p in params.items():
                if tuple(sd[n].shape) != tuple(p.shape):
                    raise CheckpointError(
                        f"{ckpt}: tensor '{n}' has shape "
                        f"{tuple(sd[n].shape)}, model has {tuple(p.shape)}"
                    )
                p.copy_(sd[n])


def save_policy_checkpoint(
    policy, out_dir: str | Path, with_base: bool = True, base_ckpt: str | Path | None = None
) -> Path:
    """Collective: write ``policy`` (LoRA shards, plus base shards when ``with_base``) as a
    checkpoint that ``tools/convert_ckpt.py export`` reads. Without base shards,
    ``base_ckpt`` (a checkpoint from ``import`` with the same layout) or the HF directory
    ``policy.cfg.hf_path`` supplies the base on export. Atomic (temp dir, then rename)."""
    out = Path(out_dir)
    fileio.check_out_dir(out, {"HF model directory": Path(policy.cfg.hf_path)}, "out_dir")
    tmp = fileio.tmp_sibling(out)
    dist.barrier()  # every rank checked before rank 0 creates anything
    if dist.get_rank() == 0:
        fileio.fresh_tmp_dir(out)
        copy_hf_metadata(Path(policy.cfg.hf_path), tmp / "hf")
    dist.barrier()
    if with_base:
        save_shards(policy, tmp, with_lora=True)
    else:
        from safetensors.torch import save_file

        dense, expert = _split(policy.lora_state_dict())
        dname, ename = _shard_names(policy.groups, "lora_")
        if policy.groups.dp_rank == 0 and dense:
            save_file(dense, str(tmp / dname))
        if policy.groups.expert_dp_rank == 0 and expert:
            save_file(expert, str(tmp / ename))
    dist.barrier()
    if dist.get_rank() == 0:
        from megagrpo.model.policy import layout_of

        write_meta(
            tmp,
            asdict(layout_of(policy.groups)),
            policy.groups.world_size,
            policy.cfg.dtype,
            policy.cfg.lora,
            has_lora=True,
            base=None if with_base else str(base_ckpt or policy.cfg.hf_path),
            spec=policy.spec,
            moe_grouped_gemm=policy.grouped_experts,
        )
        fileio.replace_dir(tmp, out)
    dist.barrier()
    return out


def _peak_rss_mb() -> float:
    """Peak resident memory of this process (VmHWM; unlike ru_maxrss on Linux it is not
    inherited from the parent across fork/exec). Falls back to ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker_report(rank: int, t0: float, t_load: float, **sizes: int) -> dict:
    """What a converter rank returns: its timings since ``t0``, peak RSS and ``sizes``."""
    return {
        "rank": rank,
        "load_s": t_load,
        "total_s": time.perf_counter() - t0,
        "peak_rss_mb": _peak_rss_mb(),
        **sizes,
    }


def import_worker(rank: int, job: dict) -> dict:
    """One rank of ``import``: stream HF weights into the shards, write them to job['tmp']."""
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    groups = init_parallel(ParallelConfig(**job["layout"]))
    try:
        t0 = time.perf_counter()
        lora = LoraConfig(**job["lora"])
        mcfg = ModelConfig(
            hf_path=job["hf"], lora=lora, dtype=job["dtype"], spec=job.get("spec", "local")
        )
        policy = build_policy(mcfg, groups)
        t_load = time.perf_counter() - t0
        save_shards(policy, Path(job["tmp"]), with_lora=False)
        dist.barrier()
        return _worker_report(
            rank,
            t0,
            t_load,
            shard_bytes=sum(
                p.numel() * p.element_size()
                for n, p in policy.model.named_parameters()
                if ".adapter." not in n
            ),
        )
    finally:
        destroy_parallel()


def export_worker(rank: int, job: dict) -> dict:
    """One rank of ``export``: load shards, then write merged HF safetensors or a PEFT
    adapter (rank 0 writes into job['tmp'])."""
    from safetensors.torch import save_file

    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    meta, ckpt = job["meta"], Path(job["ckpt"])
    mcfg = model_config_of(meta, str(ckpt / "hf"))
    base = meta.get("base")
    base_ckpt = bool(base) and (Path(base) / META).is_file()
    if base_ckpt and model_config_of(read_meta(Path(base)), "").spec != mcfg.spec:
        raise CheckpointError(
            f"{ckpt}: its LoRA shards were written under model.spec={mcfg.spec}, the base "
            f"checkpoint {base} under another spec (their Megatron names differ)"
        )
    groups = init_parallel(ParallelConfig(**meta["layout"]))
    try:
        t0 = time.perf_counter()
        if base and not base_ckpt:  # base weights from an HF directory
            policy = build_policy(dataclasses.replace(mcfg, hf_path=base), groups)
        else:
            policy = build_policy(mcfg, groups, load_weights=False)
            load_shards(policy, Path(base) if base else ckpt, with_lora=False)
        if meta["has_lora"]:
            load_lora_shards(policy, ckpt)
        t_load = time.perf_counter() - t0
        out, written = Path(job["tmp"]), 0
        if job["mode"] == "adapter":
            policy.export_peft_adapter(out / "adapter")
        else:
            index: dict[str, str] = {}
            buckets = policy.export_hf_weights(
                merge_lora=job["mode"] == "merged", bucket_bytes=job["bucket_bytes"]
            )
            for i, bucket in enumerate(buckets):
                written += sum(t.numel() * t.element_size() for _, t in bucket)
                if rank == 0:
                    fname = f"model-{i + 1:05d}.safetensors"
                    save_file(
                        {k: t.cpu() for k, t in bucket}, str(out / fname), metadata={"format": "pt"}
                    )
                    index.update({k: fname for k, _ in bucket})
            if rank == 0:
                fileio.write_text(
                    out / "model.safetensors.index.json",
                    json.dumps(
                        {"metadata": {"total_size": written}, "weight_map": index}, indent=1
                    ),
                )
        dist.barrier()
        return _worker_report(rank, t0, t_load, bytes=written)
    finally:
        destroy_parallel()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
"""Weight files in an HF model directory (every format), with their ``*.index.json``."""


def is_weight_file(name: str) -> bool:
    """True for a weight file of any format or a weight index (``*.index.json``)."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def copy_hf_metadata(src: Path, dst: Path) -> None:
    """config.json, tokenizer and generation files: everything but the weights of any format
    (a base that also ships ``pytorch_model.bin`` must not put an unmerged model beside the
    merged safetensors) and their indexes."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not is_weight_file(f.name):
            fileio.library_write(dst / f.name, lambda path, f=f: shutil.copy2(f, path))


def world_of(layout: dict) -> int:
    import math

    return math.lcm(layout["tp"], layout["ep"] * layout["etp"]) * layout["pp"]


# Keys of megagrpo_ckpt.json that export reads, with their JSON types.
_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "layout": dict,
    "world_size": int,
    "dtype": str,
    "lora": dict,
    "has_lora": bool,
    "base": (str, type(None)),
}


def model_config_of(meta: dict, hf_path: str) -> ModelConfig:
    """The ``ModelConfig`` that rebuilds the modules a checkpoint's shards were saved from.
    Megatron parameter names depend on the layer spec: the TE spec fuses the layernorms
    into ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``) and its grouped experts hold
    ``weight0..weight{n-1}`` (no ``local_experts.{j}``). A checkpoint written before the spec
    was recorded gets ``auto``, what wrote it then."""
    return ModelConfig(
        hf_path=hf_path,
        lora=LoraConfig(**meta["lora"]),
        dtype=meta["dtype"],
        spec=meta.get("spec", "auto"),
        moe_grouped_gemm=meta.get("moe_grouped_gemm", True),
    )


def read_meta(ckpt: Path) -> dict:
    """The checkpoint's ``megagrpo_ckpt.json``, checked: CheckpointError naming the file and
    the key when it is missing, not JSON, of another format, or holds a value of a wrong type."""
    path = ckpt / META
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: not a megagrpo checkpoint ({META} missing)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    for key, types in _META_TYPES.items():
        if key not in meta:
            raise CheckpointError(f"{path}: key '{key}' missing")
        if not isinstance(meta[key], types) or (types is int and isinstance(meta[key], bool)):
            raise CheckpointError(f"{path}: key '{key}' has a wrong type: {meta[key]!r:.60}")
    if meta.get("spec", "auto") not in ("auto", "local", "te") or not isinstance(
        meta.get("moe_grouped_gemm", True), bool
    ):
        raise CheckpointError(f"{path}: key 'spec' or 'moe_grouped_gemm' has a wrong value")
    for section, cls in (("layout", ParallelConfig), ("lora", LoraConfig)):
        unknown = set(meta[section]) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise CheckpointError(f"{path}: unknown key(s) {sorted(unknown)} in '{section}'")
    return meta


def write_meta(
    out: Path,
    layout: dict,
    world: int,
    dtype: str,
    lora: LoraConfig,
    has_lora: bool,
    base: str | None = None,
    spec: str = "local",
    moe_grouped_gemm: bool = True,
) -> None:
    """``base``: where base weights live when this checkpoint holds only LoRA shards (a
    megagrpo checkpoint of the same layout, or an HF directory). ``spec`` /
    ``moe_grouped_gemm``: the layer spec the shards' names come from
    (:func:`model_config_of`)."""
    meta = {
        "format": FORMAT,
        "layout": layout,
        "world_size": world,
        "dtype": dtype,
        "lora": asdict(lora),
        "has_lora": has_lora,
        "base": base,
        "spec": spec,
        "moe_grouped_gemm": moe_grouped_gemm,
    }
    fileio.write_text(out / META, json.dumps(meta, indent=2))


def atomic_dir(out: Path, protected: dict[str, Path] | None = None) -> Path:
    """A fresh temp sibling of ``out`` (rename it with :func:`commit_dir`). ConfigError when
    ``out`` exists and is not empty, or is, contains or lies inside a ``protected`` input."""
    fileio.check_out_dir(out, protected or {})
    return fileio.fresh_tmp_dir(out, unique=True)


def commit_dir(tmp: Path, out: Path) -> None:
    fileio.replace_dir(tmp, out)
