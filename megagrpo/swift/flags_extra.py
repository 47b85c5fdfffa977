"""ms-swift flags of the adapter targets, the chat template, the data order and the run's name
-> megagrpo keys (used by `megagrpo from-swift`; reviews/ms-swift-users-4.md F1/F2).

* ``--target_parameters`` (peft's LoRA on 3-D parameters: the experts of a transformers-5
  MoE, ``mlp.experts.gate_up_proj`` / ``down_proj``) -> megagrpo's expert LoRA
  (``expert_linear_fc1`` / ``expert_linear_fc2``: one A and B per expert, gate and up fused
  as in the checkpoint), the names ``megagrpo export --format peft`` writes back;
* ``--target_regex`` (replaces ``--target_modules``; peft full-matches it against module
  names): matched against one layer's linears of the launcher's model;
* ``--use_rslora`` (scale alpha / sqrt(r)): ``model.lora.alpha`` = alpha x sqrt(r), the same
  update;
* ``--template`` / ``--model_type``: the model's own (megagrpo renders the tokenizer's chat
  template and reads config.json), else not supported;
* ``--data_seed`` / ``--dataset_shuffle`` / ``--train_dataloader_shuffle``: the sampler's seed
  and order;
* ``--wandb_exp_name`` / ``--run_name``: ``trainer.name`` (the W&B run and runs/<name>);
* ``--warmup_steps``; the ``cosine_*`` / ``repetition_*`` reward settings.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from megagrpo.swift.flags import (
    DIFFERS,
    EXACT,
    HARMLESS,
    HF_TARGETS,
    MISSING,
    Translation,
    _bool,
    _list,
)

EXPERT_PARAMETERS = {"gate_up_proj": "expert_linear_fc1", "down_proj": "expert_linear_fc2"}
"""transformers-5 MoE expert parameters (``mlp.experts.<name>``) -> megagrpo's expert LoRA."""
FAMILIES = ("qwen3", "qwen2", "qwen", "llama", "mistral", "internvl", "deepseek", "glm", "gemma")
"""Model families, most specific first, read off a model_type / template / directory name."""


def translate_extra(t: Translation) -> None:
    """Every rule of this module."""
    _target_parameters(t)
    _target_regex(t)
    _rslora(t)
    _template(t)
    _model_type(t)
    _data_order(t)
    _run_name(t)
    t.copy("warmup_steps", "trainer.warmup_steps", int)
    _reward_settings(t)


def _add_targets(t: Translation, extra: list[str]) -> list[str]:
    targets = list(t.overrides.get("model.lora.targets", []))
    out = targets + [x for x in extra if x not in targets]
    t.overrides["model.lora.targets"] = out
    return out


def _target_parameters(t: Translation) -> None:
    if "target_parameters" not in t.flags:
        return
    names = [str(x) for x in _list(t.get("target_parameters"))]
    mapped, unknown = [], []
    for name in names:
        key = name.rsplit(".", 1)[-1]
        if key in EXPERT_PARAMETERS and ("experts" in name or "." not in name):
            mapped.append(EXPERT_PARAMETERS[key])
        else:
            unknown.append(name)
    if unknown:
        t.add(
            "target_parameters",
            MISSING,
            {},
            f"not supported: {unknown} (megagrpo adapts the experts' gate_up_proj / down_proj "
            "parameters, mlp.experts.*)",
        )
        return
    targets = list(t.overrides.get("model.lora.targets", []))
    covered = [m for m in mapped if m.removeprefix("expert_") in targets]
    keys = {"model.lora.targets": _add_targets(t, sorted(set(mapped)))}
    t.add(
        "target_parameters",
        EXACT,
        keys,
        "the experts' own LoRA (one A and B per expert, gate and up fused as in the "
        "checkpoint): megagrpo's expert_linear_fc1 / expert_linear_fc2, the parameters "
        "`megagrpo export --format peft` writes back"
        + (f" ({', '.join(covered)} already adapted by target_modules)" if covered else ""),
    )


def _layer_names(t: Translation) -> dict[str, str]:
    """One layer's linears as the launcher names them -> megagrpo's target."""
    if t.flavor == "megatron":
        pre = "decoder.layers.0."
        return {
            pre + "self_attention.linear_qkv": "linear_qkv",
            pre + "self_attention.linear_proj": "linear_proj",
            pre + "mlp.linear_fc1": "linear_fc1",
            pre + "mlp.linear_fc2": "linear_fc2",
            pre + "mlp.experts.linear_fc1": "expert_linear_fc1",
            pre + "mlp.experts.linear_fc2": "expert_linear_fc2",
            pre + "mlp.router": "",
        }
    pre = "model.layers.0."
    out = {pre + f"self_attn.{p}": HF_TARGETS[p] for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    out |= {pre + f"mlp.{p}": HF_TARGETS[p] for p in ("gate_proj", "up_proj", "down_proj")}
    out |= {pre + f"mlp.experts.0.{p}": "expert_" + HF_TARGETS[p] for p in ("gate_proj", "up_proj")}
    out[pre + "mlp.experts.0.down_proj"] = "expert_linear_fc2"
    out[pre + "mlp.gate"] = ""  # the router
    return out


def _target_regex(t: Translation) -> None:
    """peft full-matches ``--target_regex`` against module names; it replaces target_modules."""
    if "target_regex" not in t.flags:
        return
    pattern = str(t.get("target_regex"))
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        t.add("target_regex", MISSING, {}, f"not a regular expression: {exc}")
        return
    names = _layer_names(t)
    hit = [n for n in names if regex.fullmatch(n)]
    other = [n for n in names if regex.fullmatch(n.replace(".0.", ".1."))]
    targets = sorted({names[n] for n in hit if names[n]})
    if set(hit) != set(other) or not targets:
        t.add(
            "target_regex",
            MISSING,
            {},
            "not supported: it selects "
            + ("no linear of a layer" if not targets else "other linears in other layers")
            + " (megagrpo adapts the same linears in every layer)",
        )
        return
    router = [n for n in hit if not names[n]]
    t.overrides["model.lora.targets"] = targets
    t.entries = [e for e in t.entries if e.flag != "target_modules"]
    t.add(
        "target_regex",
        DIFFERS,
        {"model.lora.targets": targets},
        f"matches {', '.join(n.split('.0.', 1)[1] for n in hit)} in each layer; megagrpo "
        "adapts fused Megatron linears (q/k/v share linear_qkv, gate/up linear_fc1)"
        + ("; the router is not adapted" if router else ""),
    )


def _rslora(t: Translation) -> None:
    if "use_rslora" not in t.flags:
        return
    if not _bool(t.get("use_rslora")):
        t.add("use_rslora", EXACT, {}, "alpha / r, as megagrpo scales")
        return
    rank = int(t.overrides.get("model.lora.rank", t.get("lora_rank", 8)))
    alpha = float(t.overrides.get("model.lora.alpha", t.get("lora_alpha", 32.0)))
    scaled = alpha * math.sqrt(rank)
    t.add(
        "use_rslora",
        EXACT,
        {"model.lora.alpha": scaled},
        f"rsLoRA scales by alpha / sqrt(r) = {alpha:g} / sqrt({rank}): written as "
        f"model.lora.alpha = {scaled:g} (alpha' / r, the same update and gradients); the "
        f"exported adapter says lora_alpha {scaled:g}",
    )


def family(name: str) -> str | None:
    """The model family a model_type, template or model name belongs to (None: unknown)."""
    low = name.lower().replace("-", "").replace(".", "")
    return next((f for f in FAMILIES if low.startswith(f) or f"/{f}" in low), None)


def _model_family(t: Translation) -> tuple[str | None, str]:
    """The family of the model, from its config.json (else its name), and where from."""
    name = str(t.get("model", ""))
    cfg = Path(name).expanduser() / "config.json"
    if cfg.is_file():
        kind = str(json.loads(cfg.read_text(encoding="utf-8")).get("model_type", ""))
        return family(kind), f"config.json model_type {kind!r}"
    base = name.rstrip("/").split("/")[-1]
    return family(base), f"the model name {base!r}"


def _template(t: Translation) -> None:
    """ms-swift's template of the model's family renders its chat template: the tokenizer's
    chat template megagrpo renders; another family's template is not supported."""
    if "template" not in t.flags:
        return
    name = str(t.get("template"))
    mine, where = _model_family(t)
    theirs = family(name)
    if mine is None or theirs != mine:
        t.add(
            "template",
            MISSING,
            {},
            f"not supported: template {name!r} is not the model's own ({where}): megagrpo "
            "renders the tokenizer's chat template",
        )
        return
    variant = name.lower().split("_")[-1] if "_" in name else ""
    if variant in ("thinking", "nothinking"):
        t.add(
            "template",
            DIFFERS,
            {},
            f"the {mine} family's {variant} template: megagrpo renders the tokenizer's chat "
            "template; set data.prompt.enable_thinking to match",
        )
        return
    t.add("template", EXACT, {}, f"the model's own ({where}): the tokenizer's chat template")


def _model_type(t: Translation) -> None:
    """``--model_type`` names ms-swift's loader and template for the model: harmless when it
    is the model's family (megagrpo reads config.json); a multimodal or another family's
    type is not supported."""
    if "model_type" not in t.flags:
        return
    from megagrpo.swift.fidelity import MULTIMODAL

    kind = str(t.get("model_type"))
    mine, where = _model_family(t)
    if MULTIMODAL.search(kind):
        t.add("model_type", MISSING, {}, f"not supported: {kind} is a multimodal model type")
    elif mine is not None and family(kind) not in (None, mine):
        t.add("model_type", MISSING, {}, f"not supported: {kind} is not the model's type ({where})")
    else:
        t.add(
            "model_type",
            HARMLESS,
            {},
            "ms-swift's loader and template for the model: megagrpo reads the architecture "
            "from config.json and renders the tokenizer's chat template",
        )


def _data_order(t: Translation) -> None:
    if "data_seed" in t.flags:
        t.add(
            "data_seed",
            DIFFERS,
            {"curriculum.seed": int(t.get("data_seed"))},
            "the seed of megagrpo's sampler (its order is not ms-swift's RepeatSampler's, "
            "whatever the seed)",
        )
    for flag in ("dataset_shuffle", "train_dataloader_shuffle"):
        if flag not in t.flags:
            continue
        if _bool(t.get(flag)):
            t.add(flag, EXACT, {}, "rows drawn in random order, as ms-swift")
        else:
            t.add(
                flag,
                DIFFERS,
                {},
                "ms-swift trains the rows in file order; megagrpo's sampler draws them at "
                "random (the same rows every epoch)",
            )


def _run_name(t: Translation) -> None:
    for flag in ("wandb_exp_name", "run_name"):
        if flag not in t.flags:
            continue
        name = str(t.get(flag))
        if name and not any(c in name for c in "/\\\0") and not name.startswith("."):
            t.add(flag, DIFFERS, {"trainer.name": name}, "the W&B run name and runs/<name>")
        else:
            t.add(flag, HARMLESS, {}, f"{name!r} is no directory name: trainer.name kept")


def _reward_settings(t: Translation) -> None:
    """``cosine_*`` / ``repetition_*`` (but repetition_penalty): kwargs of ms-swift's cosine /
    repetition rewards (passed by :func:`~megagrpo.swift.flags_run.translate_data_rewards`)."""
    funcs = [str(x) for x in _list(t.get("reward_funcs", []))]
    for flag in list(t.flags):
        if not flag.startswith(("cosine_", "repetition_")) or flag == "repetition_penalty":
            continue
        owner = flag.split("_", 1)[0]
        if owner in funcs:
            t.add(flag, EXACT, {}, f"a setting of ms-swift's {owner} reward (orms:{owner})")
        else:
            t.add(flag, HARMLESS, {}, f"no effect without {owner} in --reward_funcs")
