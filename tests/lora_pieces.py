"""Layout-free LoRA pieces written by hand, for checkpoint and export tests without a policy."""

from __future__ import annotations


def whole_lora_pieces(model_dir, lora_cfg=None, value: float = 0.01) -> list[dict]:
    """Layout-free LoRA pieces (:mod:`megagrpo.model.lora_state`) of the model in
    ``model_dir`` as one process would write them: one piece per unit, every element
    ``value``, no optimiser state. For checkpoint and export tests without a policy."""
    import torch

    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.config import LoraConfig
    from megagrpo.model.hf_mapping import hf_weight_shapes
    from megagrpo.model.lora_state import a_unit_of, unit_shape
    from megagrpo.model.peft_export import lora_target

    lora = lora_cfg or LoraConfig()
    shapes = hf_weight_shapes(arch_from_hf(load_hf_config(model_dir)))
    pieces = []
    for name in shapes:
        if lora_target(name, lora.targets) is None:
            continue
        for factor in ("A", "B") if a_unit_of(name) == name else ("B",):
            shape = unit_shape(name, factor, shapes, lora.rank)
            pieces.append(
                {
                    "name": name,
                    "factor": factor,
                    "bounds": [[0, n] for n in shape],
                    "param": torch.full(shape, value),
                    "state": {},
                }
            )
    return pieces
