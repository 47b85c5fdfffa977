"""The provider's TransformerConfig under pipeline parallelism, built by the real megatron-core
0.16.1: dense models too (its default token dispatcher, allgather, refuses the
variable_seq_lengths every pipeline run sets: ValueError in TransformerConfig.__post_init__)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from megagrpo.model.arch import arch_from_hf, load_hf_config
from megagrpo.model.config import ModelConfig


def _groups(pp: int):
    return SimpleNamespace(
        tp_size=1,
        pp_size=pp,
        ep_size=1,
        etp_size=1,
        sequence_parallel=False,
        fake=True,
        first_stage_layers=0,
        last_stage_layers=0,
        layer_span=lambda n: (0, n // pp),
    )


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_pipeline_config_builds_for_dense_and_moe(kind, tiny_dense_dir, tiny_moe_dir):
    from megagrpo.model.provider import transformer_config

    path = tiny_dense_dir if kind == "dense" else tiny_moe_dir
    arch = arch_from_hf(load_hf_config(path))
    groups: Any = _groups(2)  # the provider reads only these fields
    cfg = transformer_config(arch, ModelConfig(hf_path=str(path)), groups, "local")
    assert cfg.variable_seq_lengths and cfg.calculate_per_token_loss
    assert cfg.moe_token_dispatcher_type == "alltoall"
    assert cfg.pipeline_model_parallel_size == 2
