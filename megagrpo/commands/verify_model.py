"""`megagrpo verify-model --hf DIR [--tp N --ep N ...]`: the parallel Megatron model against
transformers' own model.

Launches the layout's gloo ranks itself (or runs in-process for one rank), loads the HF
weights into the sharded model, and compares logits on fixed inputs with
``AutoModelForCausalLM`` in fp32; checks that zero-initialised LoRA leaves the logits
unchanged and that HF -> Megatron -> HF round-trips bitwise. ``--meta`` builds one rank of a
full-size layout on the meta device instead and reports parameter counts and shard sizes.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

DESCRIPTION = __doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument(
        "--world", type=int, default=0, help="number of ranks (default: lcm(tp, ep*etp) * pp)"
    )
    p.add_argument(
        "--first-stage-layers",
        type=int,
        default=-1,
        help="layers of the first pipeline stage (default: an even split, or, when --pp does "
        "not divide the layers, the rest after the other stages' layers // pp each)",
    )
    p.add_argument(
        "--last-stage-layers", type=int, default=0, help="layers of the last pipeline stage"
    )
    p.add_argument("--no-sp", action="store_true", help="disable sequence parallel (dense only)")
    p.add_argument("--seq", type=int, default=16, help="tokens per row of the fixed input")
    p.add_argument(
        "--tol",
        type=float,
        default=1e-5,
        help="accepted max |logit diff| relative to max |reference logit|",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--meta",
        action="store_true",
        help="size a full model on the meta device (no weights, no memory)",
    )
    p.add_argument("--hf-config", help="with --meta: the config.json to size")
    p.add_argument("--rank", type=int, default=0, help="with --meta: which rank to build")
    p.add_argument("--dtype", default="bfloat16", help="with --meta: parameter dtype")


def run(args: argparse.Namespace) -> int:
    from megagrpo.errors import ConfigError

    if args.meta:
        from megagrpo.model.meta import meta_report

        if not (args.hf_config or args.hf):
            raise ConfigError("--meta needs --hf-config FILE (or --hf DIR)")
        from megagrpo.model.arch import load_hf_config

        layers = int(load_hf_config(args.hf_config or args.hf)["num_hidden_layers"])
        report = meta_report(
            args.hf_config or args.hf, _layout(args, layers), _world(args), args.rank, args.dtype
        )
        _print(report, args.json)
        return 0
    if not args.hf:
        raise ConfigError("--hf DIR is required (or use --meta --hf-config FILE)")
    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.pretrained import resolve_model_path
    from megagrpo.model.verify import fixed_inputs, hf_reference_logits, run_layout
    from megagrpo.parallel import ParallelConfig, validate_layout

    # a directory, or a bundled name (smollm2-135m); parity needs the weights only
    args.hf = str(resolve_model_path(args.hf, need_tokenizer=False))
    arch = arch_from_hf(load_hf_config(args.hf))
    layout, world = _layout(args, arch.num_layers), _world(args)
    validate_layout(ParallelConfig(**layout), arch.raw, world)
    ids = fixed_inputs(min(arch.vocab_size, 32000), seq=args.seq)
    rep = run_layout(args.hf, layout, world, ids)
    ref = hf_reference_logits(args.hf, ids)
    diff = (rep.pop("logits") - ref).abs().max().item()
    scale = ref.abs().max().item()
    out = {
        "max_abs_logit_diff": diff,
        "max_abs_ref_logit": scale,
        "rel_logit_diff": diff / max(scale, 1e-12),
        **rep,
    }
    out["ok"] = bool(
        out["rel_logit_diff"] <= args.tol
        and out["lora_zero_init_max_diff"] == 0.0
        and out["roundtrip_bitwise"]
    )
    _print(out, args.json)
    return 0 if out["ok"] else 1


def _layout(args, num_layers: int) -> dict:
    from megagrpo.parallel import ParallelConfig
    from megagrpo.parallel.config import uneven_split

    sp = args.tp > 1 and not args.no_sp
    first = args.first_stage_layers
    if first < 0:
        first = 0 if args.last_stage_layers else uneven_split(num_layers, args.pp)
    return asdict(
        ParallelConfig(
            tp=args.tp,
            ep=args.ep,
            etp=args.etp,
            pp=args.pp,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=args.last_stage_layers,
            sequence_parallel=sp,
        )
    )


def _world(args) -> int:
    if args.world:
        return args.world
    return math.lcm(args.tp, args.ep * args.etp) * args.pp


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    for k, v in report.items():
        print(f"{k:>28}: {v}")
