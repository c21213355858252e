"""Ground pieces shared by model families."""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """A model config lacks a required key or has a wrong value."""


@dataclasses.dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, config: dict):
        """Build from a HF ``config.json`` dict: unknown keys are ignored, missing required keys raise
        ``ConfigError`` naming them."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [
            name
            for name, f in fields.items()
            if name not in config and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"model config lacks required key(s): {', '.join(missing)}")
        return cls(**{k: v for k, v in config.items() if k in fields})
