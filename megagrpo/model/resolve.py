"""``model.hf_path`` → HF checkpoint directory (bundled names are converted once)."""

from __future__ import annotations

from pathlib import Path

from megagrpo.errors import ConfigError


def resolve_hf_path(hf_path: str) -> Path:
    """A directory with config.json; bundled names (e.g. ``smollm2-135m``) are resolved by
    :mod:`megagrpo.trainer.pretrained`. Raises ConfigError naming ``model.hf_path``."""
    path = Path(hf_path).expanduser()
    if (path / "config.json").is_file():
        return path
    try:
        from megagrpo.trainer.pretrained import resolve_model_path
    except ImportError:
        resolve_model_path = None
    if resolve_model_path is not None:
        return Path(resolve_model_path(hf_path))
    raise ConfigError(f"config key 'model.hf_path': {hf_path!r} has no config.json")
