#!/usr/bin/env python
"""Convert checkpoints: HF ⇄ megagrpo/Megatron (per-rank shards), LoRA merge / adapter export.

    python tools/convert_ckpt.py import --hf HF_DIR --out CKPT [--tp N --ep N --etp N --pp N]
    python tools/convert_ckpt.py export --ckpt CKPT --out DIR [--merge-lora | --adapter-only]
    python tools/convert_ckpt.py --quick   # a tiny model through both, checked bitwise

``import`` launches the layout's ranks (gloo on CPU), streams the HF safetensors into each
rank's shards and writes them with the layout. ``export`` reloads under that layout and
writes HF safetensors + config + tokenizer that transformers loads (``--merge-lora`` folds
LoRA shards in when present), or a PEFT adapter (``--adapter-only``: adapter_config.json +
adapter_model.safetensors). Output is written to a temp directory and renamed when complete.
Bad input (missing files, unknown tensors, wrong shapes, a layout that does not divide the
model) exits with status 2 and a message naming the tensor or key.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

log = logging.getLogger("convert_ckpt")


def _layout(args) -> dict:
    from megagrpo.parallel import ParallelConfig

    return asdict(
        ParallelConfig(
            tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp, sequence_parallel=args.tp > 1
        )
    )


def cmd_import(args) -> dict:
    from megagrpo.model.config import LoraConfig
    from megagrpo.model.megatron_ckpt import (
        atomic_dir,
        check_hf_dir,
        commit_dir,
        copy_hf_metadata,
        import_worker,
        world_of,
        write_meta,
    )
    from megagrpo.parallel import ParallelConfig, validate_layout
    from megagrpo.parallel.launch import launch

    hf, out = Path(args.hf), Path(args.out)
    cfg = check_hf_dir(hf)
    layout = _layout(args)
    world = world_of(layout)
    validate_layout(ParallelConfig(**layout), cfg, world)
    tmp = atomic_dir(out, {"HF model directory": hf})
    try:
        lora = LoraConfig()
        job = dict(  # the local spec on any device: shards any machine can export
            hf=str(hf),
            tmp=str(tmp),
            layout=layout,
            lora=asdict(lora),
            dtype=args.dtype,
            spec="local",
        )
        stats = launch(import_worker, world, job)
        copy_hf_metadata(hf, tmp / "hf")
        write_meta(tmp, layout, world, args.dtype, lora, has_lora=False, spec="local")
        commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"world_size": world, "ranks": stats}


def cmd_export(args) -> dict:
    from megagrpo.errors import ConfigError
    from megagrpo.model.megatron_ckpt import (
        atomic_dir,
        commit_dir,
        copy_hf_metadata,
        export_worker,
        read_meta,
    )
    from megagrpo.parallel.launch import launch

    ckpt, out = Path(args.ckpt), Path(args.out)
    meta = read_meta(ckpt)
    if args.adapter_only and not meta["has_lora"]:
        raise ConfigError(f"--adapter-only: checkpoint {ckpt} holds no LoRA shards")
    mode = (
        "adapter"
        if args.adapter_only
        else ("merged" if args.merge_lora or meta["has_lora"] else "base")
    )
    tmp = atomic_dir(out, {"checkpoint": ckpt})
    try:
        job = dict(
            ckpt=str(ckpt), tmp=str(tmp), meta=meta, mode=mode, bucket_bytes=args.shard_mb << 20
        )
        stats = launch(export_worker, meta["world_size"], job)
        if mode == "adapter":
            for f in (tmp / "adapter").iterdir():
                f.rename(tmp / f.name)
            (tmp / "adapter").rmdir()
        else:
            copy_hf_metadata(ckpt / "hf", tmp)
        commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"mode": mode, "world_size": meta["world_size"], "ranks": stats}


def quick() -> int:
    """``--quick``: a random tiny dense model through import and export (one rank, a temp
    dir); exit 1 unless the exported tensors equal the original ones bitwise."""
    import tempfile

    from safetensors.torch import load_file

    from megagrpo.testing import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="convert_ckpt_") as tmp:
        hf = build_tiny_model(Path(tmp) / "hf", "dense")
        ns = dict(tp=1, ep=1, etp=1, pp=1, dtype="float32")
        cmd_import(argparse.Namespace(hf=str(hf), out=f"{tmp}/ckpt", **ns))
        out = Path(tmp) / "out"
        cmd_export(
            argparse.Namespace(
                ckpt=f"{tmp}/ckpt", out=str(out), merge_lora=False, adapter_only=False, shard_mb=64
            )
        )
        want = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
        got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
        same = want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)
    print(f"quick: tiny dense model imported and exported: {len(got)} tensors, bitwise {same}")
    return 0 if same else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="import + export a random tiny dense model in a temp dir, check it round-trips",
    )
    sub = p.add_subparsers(dest="cmd")
    imp = sub.add_parser("import", help="HF checkpoint -> megagrpo/Megatron checkpoint")
    imp.add_argument("--hf", required=True)
    imp.add_argument("--out", required=True)
    for k in ("tp", "ep", "etp", "pp"):
        imp.add_argument(f"--{k}", type=int, default=1)
    imp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    exp = sub.add_parser("export", help="megagrpo checkpoint -> HF safetensors or PEFT adapter")
    exp.add_argument("--ckpt", required=True)
    exp.add_argument("--out", required=True)
    g = exp.add_mutually_exclusive_group()
    g.add_argument("--merge-lora", action="store_true", help="fold LoRA into the weights")
    g.add_argument("--adapter-only", action="store_true", help="write a PEFT adapter only")
    exp.add_argument("--shard-mb", type=int, default=2048, help="max safetensors file size")
    for q in (imp, exp):
        q.add_argument("--json", action="store_true", help="print timing stats as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parents[1]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from megagrpo.errors import MegagrpoError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        return quick()
    if args.cmd is None:
        parser.error("give a command: import or export (or --quick)")
    try:
        stats = cmd_import(args) if args.cmd == "import" else cmd_export(args)
    except MegagrpoError as exc:
        print(f"convert_ckpt {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else f"{args.cmd}: done -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
