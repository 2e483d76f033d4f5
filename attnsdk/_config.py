"""``AttentionConfig``: which backend to use and its options, from code, a file or the environment."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator

from attnsdk._errors import UnsupportedConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["AttentionConfig", "AutoOptions"]

ENV_BACKEND = "ATTNSDK_BACKEND"
ENV_CONFIG = "ATTNSDK_CONFIG"


class AutoOptions(BaseModel):
    """Options of ``backend="auto"``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: tuple[str, ...] | None = None
    """Restrict (and order) the backends "auto" may pick; None = all, by priority."""


class AttentionConfig(BaseModel):
    """Frozen backend choice, discriminated on ``backend``; the options model is the backend's own.

    Options may be given flat or under ``options``; unknown fields are rejected.

    >>> AttentionConfig.model_validate({"backend": "reference", "max_scores": 4096}).options
    ReferenceOptions(max_scores=4096)
    >>> AttentionConfig().backend
    'auto'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str = "auto"
    options: SerializeAsAny[BaseModel] = Field(default_factory=AutoOptions)

    @model_validator(mode="before")
    @classmethod
    def _split_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        backend = data.pop("backend", "auto")
        nested = data.pop("options", None)
        if nested is not None and data:
            raise ValueError(
                f"give backend options either flat or under 'options', not both (found {sorted(data)})"
            )
        options = nested if nested is not None else data
        model = _options_model(backend)
        if isinstance(options, model):
            return {"backend": backend, "options": options}
        if isinstance(options, BaseModel):
            raise ValueError(
                f"options for backend {backend!r} must be {model.__name__}, found {type(options).__name__}"
            )
        return {"backend": backend, "options": model.model_validate(options)}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AttentionConfig:
        """Load a ``.json``, ``.toml`` or (with PyYAML installed) ``.yaml`` / ``.yml`` file.

        A TOML file may hold the config at top level or under an ``[attnsdk]`` table.
        """
        p = Path(path)
        if not p.is_file():
            raise UnsupportedConfigError(f"attention config file {str(p)!r} does not exist")
        parse = _parser(p.suffix.lower(), p.name)
        try:
            data = parse(p.read_text())
        except Exception as exc:  # each parser has its own error type; report them alike
            raise UnsupportedConfigError(
                f"attention config file {str(p)!r} cannot be parsed: {exc}"
            ) from exc
        if p.suffix.lower() == ".toml":
            data = data.get("attnsdk", data)
        if not isinstance(data, dict):
            raise UnsupportedConfigError(
                f"attention config file {p.name!r}: expected a mapping, found {type(data).__name__}"
            )
        _check_backend_name(data.get("backend", "auto"))
        return cls.model_validate(data)

    @classmethod
    def from_env(cls) -> AttentionConfig:
        """``ATTNSDK_CONFIG`` (a file path) or ``ATTNSDK_BACKEND`` (a backend name), else auto."""
        path = os.environ.get(ENV_CONFIG)
        name = os.environ.get(ENV_BACKEND)
        if path:
            config = cls.from_file(path)
            if name and name != config.backend:
                raise UnsupportedConfigError(
                    f"{ENV_BACKEND}={name!r} contradicts backend {config.backend!r} in "
                    f"{ENV_CONFIG}={path!r}; set one of them"
                )
            return config
        if not name:
            return cls()
        _check_backend_name(name)
        return cls(backend=name)


def _check_backend_name(backend: Any) -> None:
    """Raise ``UnsupportedConfigError`` (not pydantic's wrapper of it) for an unknown name."""
    if isinstance(backend, str) and backend != "auto":
        from attnsdk._registry import lookup

        lookup(backend)


def _options_model(backend: Any) -> type[BaseModel]:
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a string, found {type(backend).__name__}")
    if backend == "auto":
        return AutoOptions
    from attnsdk._registry import lookup

    return lookup(backend).options_model()


def _parser(suffix: str, filename: str) -> Callable[[str], Any]:
    """The ``loads`` for a config file's suffix; a missing parser library names its install."""
    if suffix == ".json":
        return json.loads
    if suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib  # type: ignore[import-not-found]
            except ImportError:
                raise UnsupportedConfigError(
                    f"reading {filename} on Python 3.10 needs: pip install tomli"
                ) from None
        return tomllib.loads
    if suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise UnsupportedConfigError(
                f"reading {filename} needs PyYAML: pip install pyyaml (or use .json / .toml)"
            ) from None
        return yaml.safe_load
    raise UnsupportedConfigError(
        f"attention config file {filename!r}: expected a .json, .toml, .yaml or .yml suffix"
    )
