"""``AttentionConfig``: which backend to use and its options, from code, a file or the environment."""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError

from attnsdk._errors import InvalidInputError, UnsupportedConfigError

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
    debug: bool = False
    """Debug mode (also ``ATTNSDK_DEBUG=1``): validate every plan and forward, check outputs
    for NaN. It syncs the device on every layer; docs/debugging.md says when to use it."""

    def __init__(self, **data: Any) -> None:
        super().__init__(**_prepare(data))

    @classmethod
    def model_validate(cls, obj: Any) -> AttentionConfig:  # type: ignore[override]
        """Build from a mapping; every problem is an ``InvalidInputError`` naming the field."""
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise InvalidInputError("config", "a mapping of backend, options, debug", repr(obj))
        return cls(**obj)

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
        where = f"In attention config file {str(p)!r}"
        try:
            return cls.model_validate(data)
        except InvalidInputError as exc:
            hint = f"{exc.hint} {where}" if exc.hint else where
            raise InvalidInputError(exc.field, exc.expected, exc.found, hint) from None
        except UnsupportedConfigError as exc:  # e.g. an unknown backend name
            message = str(exc).split("\n", 1)[0]
            raise UnsupportedConfigError(f"{message} {where}", exc.reasons) from None

    @classmethod
    def from_env(cls) -> AttentionConfig:
        """``ATTNSDK_CONFIG`` (a file path) or ``ATTNSDK_BACKEND`` (a backend name), else auto."""
        path = os.environ.get(ENV_CONFIG)
        name = os.environ.get(ENV_BACKEND)
        if path:
            try:
                config = cls.from_file(path)
            except UnsupportedConfigError as exc:  # name the variable the path came from
                message = str(exc).split("\n", 1)[0]
                raise UnsupportedConfigError(
                    f"{ENV_CONFIG}={path!r}: {message}", exc.reasons
                ) from None
            if name and name != config.backend:
                raise UnsupportedConfigError(
                    f"{ENV_BACKEND}={name!r} contradicts backend {config.backend!r} in "
                    f"{ENV_CONFIG}={path!r}; set one of them"
                )
            return config
        if not name:
            return cls()
        return cls(backend=name)


def _prepare(data: dict[str, Any]) -> dict[str, Any]:
    """Split flat options from ``backend`` / ``debug`` and validate them with the backend's own
    options model, raising attnsdk's typed errors instead of pydantic's."""
    data = dict(data)
    backend = data.pop("backend", "auto")
    debug = data.pop("debug", False)
    nested = data.pop("options", None)
    if not isinstance(backend, str):
        raise InvalidInputError("backend", "a backend name (str)", repr(backend))
    if not isinstance(debug, bool):
        raise InvalidInputError("debug", "True or False", repr(debug))
    if nested is not None and data:
        raise InvalidInputError(
            "options", "backend options either flat or under 'options', not both", sorted(data)
        )
    options = nested if nested is not None else data
    model = _options_model(backend)
    if isinstance(options, BaseModel):
        if not isinstance(options, model):
            raise InvalidInputError(
                "options", f"a {model.__name__} (backend {backend!r})", type(options).__name__
            )
        return {"backend": backend, "options": options, "debug": debug}
    if not isinstance(options, dict):
        raise InvalidInputError("options", f"a mapping or a {model.__name__}", repr(options))
    try:
        validated = model.model_validate(options)
    except ValidationError as exc:
        raise _option_error(exc, model, backend) from None
    return {"backend": backend, "options": validated, "debug": debug}


def _option_error(exc: ValidationError, model: type[BaseModel], backend: str) -> InvalidInputError:
    """The first problem pydantic found, as a typed error naming the option."""
    err = exc.errors()[0]
    name = ".".join(str(part) for part in err["loc"])
    known = sorted(model.model_fields)
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"Did you mean {close[0]!r}?" if close else ""
        expected = f"an option of backend {backend!r}: {', '.join(known) or 'none'}"
        return InvalidInputError(f"options.{name}", expected, f"unknown option {name!r}", hint)
    more = f" ({len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    return InvalidInputError(
        f"options.{name}", f"a valid value ({err['msg']}){more}", repr(err.get("input"))
    )


def _options_model(backend: str) -> type[BaseModel]:
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
