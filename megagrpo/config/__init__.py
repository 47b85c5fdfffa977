"""Config: dataclass schema per component, YAML loading, dotted CLI overrides, validation."""

from megagrpo.config.loader import load_config, require, save_config, to_yaml

__all__ = ["load_config", "require", "save_config", "to_yaml"]
