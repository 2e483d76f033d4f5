"""``AttentionConfig``: which backend to use and its options, from code, a file or the environment."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
)

from attnsdk.contract.errors import InvalidInputError, UnsupportedConfigError
from attnsdk.selection.config_files import config_table, find_pyproject, pyproject_table
from attnsdk.selection.registry import AUTO, canonical_name, lookup

__all__ = ["AttentionConfig", "AutoOptions", "ConfigSource", "config_in_effect"]

ENV_BACKEND = "ATTNSDK_BACKEND"
ENV_CONFIG = "ATTNSDK_CONFIG"


class AutoOptions(BaseModel):
    """Options of ``backend="auto"``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: tuple[str, ...] | None = None
    """Restrict (and order) the backends "auto" may pick; None (omitted) = all, by priority."""

    @field_validator("candidates")
    @classmethod
    def _not_empty(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and not value:
            raise ValueError(
                "needs at least one backend name; omit candidates (or pass None) to let "
                '"auto" pick from every registered backend'
            )
        return value


class AttentionConfig(BaseModel):
    """Frozen backend choice, discriminated on ``backend``; the options model is the backend's own.

    Options may be given flat or under ``options``; unknown fields are rejected, with the
    closest option name. Backend names are matched ignoring case.

    >>> AttentionConfig.model_validate({"backend": "reference", "max_scores": 4096}).options
    ReferenceOptions(max_scores=4096)
    >>> AttentionConfig().backend, AttentionConfig(backend="Reference").backend
    ('auto', 'reference')
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str = AUTO
    """A registered backend name (matched ignoring case, stored as registered) or "auto"."""
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

        The config sits at top level or under an ``attnsdk`` key (an ``[attnsdk]`` table in
        TOML); a file named pyproject.toml is read from its ``[tool.attnsdk]`` table. Every
        problem names the file and the field.
        """
        p = Path(path)
        data, key = config_table(p)
        where = f"In attention config file {str(p)!r}" + (f" (under {key!r})" if key else "")
        return cls._from_table(data, where)

    @classmethod
    def from_pyproject(cls, path: str | os.PathLike[str] | None = None) -> AttentionConfig | None:
        """The ``[tool.attnsdk]`` table of a pyproject.toml, or None when it has none.

        ``path`` is the file, or a folder to search from; None searches from the current
        directory. A search takes the nearest pyproject.toml in that folder or above (the
        project's own) and returns None when there is none.
        """
        if path is None or Path(path).is_dir():
            found = find_pyproject(None if path is None else Path(path))
        else:
            found = Path(path)
        if found is None:
            return None
        table = pyproject_table(found)
        if table is None:
            return None
        return cls._from_table(table, f"In [tool.attnsdk] of {str(found)!r}")

    @classmethod
    def from_env(cls) -> AttentionConfig:
        """The config in effect, from the first of these that is set (it gives the whole config):

        1. ``ATTNSDK_CONFIG``: a config file (``from_file``); ``ATTNSDK_BACKEND`` may be set
           too only if it names the same backend;
        2. ``ATTNSDK_BACKEND``: a backend name, with its default options;
        3. ``[tool.attnsdk]`` in the nearest pyproject.toml (``from_pyproject``);
        4. ``"auto"``.
        """
        return config_in_effect()[0]

    @classmethod
    def _from_table(cls, data: dict[str, Any], where: str) -> AttentionConfig:
        """Validate a mapping read from a file; errors end with ``where`` (the file)."""
        try:
            return cls.model_validate(data)
        except InvalidInputError as exc:
            hint = f"{exc.hint} {where}" if exc.hint else where
            raise InvalidInputError(exc.field, exc.expected, exc.found, hint) from None
        except UnsupportedConfigError as exc:  # e.g. an unknown backend name
            message = str(exc).split("\n", 1)[0]
            raise UnsupportedConfigError(f"{message} {where}", exc.reasons) from None


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """Where the config in effect came from (``attnsdk info`` prints it)."""

    kind: str
    """The variable or flag that set it (``ATTNSDK_CONFIG``, ``ATTNSDK_BACKEND``, ``--backend``,
    ``--config``), ``pyproject`` for ``[tool.attnsdk]``, or ``default``."""
    value: str | None = None
    """The file or backend name it gave; None for the default."""

    def __str__(self) -> str:
        if self.kind == "pyproject":
            return f"[tool.attnsdk] in {self.value}"
        if self.value is None:
            return f"{self.kind} (none of {ENV_CONFIG}, {ENV_BACKEND}, [tool.attnsdk] is set)"
        sep = " " if self.kind.startswith("--") else "="
        return f"{self.kind}{sep}{self.value}"


def config_in_effect() -> tuple[AttentionConfig, ConfigSource]:
    """What ``AttentionConfig.from_env`` returns, and where it came from."""
    path = os.environ.get(ENV_CONFIG)
    name = os.environ.get(ENV_BACKEND)
    if path:
        try:
            config = AttentionConfig.from_file(path)
        except UnsupportedConfigError as exc:  # name the variable the path came from
            raise _from_variable(exc, ENV_CONFIG, path) from None
        if name and _canonical(name) != config.backend:
            raise UnsupportedConfigError(
                f"{ENV_BACKEND}={name!r} contradicts backend {config.backend!r} in "
                f"{ENV_CONFIG}={path!r}; set one of them"
            )
        return config, ConfigSource(ENV_CONFIG, path)
    if name:
        try:
            return AttentionConfig(backend=name), ConfigSource(ENV_BACKEND, name)
        except UnsupportedConfigError as exc:
            raise _from_variable(exc, ENV_BACKEND, name) from None
    pyproject = find_pyproject()
    table = AttentionConfig.from_pyproject(pyproject) if pyproject else None
    if table is not None:
        return table, ConfigSource("pyproject", str(pyproject))
    return AttentionConfig(), ConfigSource("default")


def _from_variable(
    exc: UnsupportedConfigError, variable: str, value: str
) -> UnsupportedConfigError:
    message = str(exc).split("\n", 1)[0]
    return UnsupportedConfigError(f"{variable}={value!r}: {message}", exc.reasons)


def _canonical(name: str) -> str:
    try:
        return canonical_name(name)
    except UnsupportedConfigError as exc:
        raise _from_variable(exc, ENV_BACKEND, name) from None


def _prepare(data: dict[str, Any]) -> dict[str, Any]:
    """Split flat options from ``backend`` / ``debug`` and validate them with the backend's own
    options model, raising attnsdk's typed errors instead of pydantic's."""
    data = dict(data)
    backend = data.pop("backend", AUTO)
    debug = data.pop("debug", False)
    nested = data.pop("options", None)
    if not isinstance(backend, str):
        raise InvalidInputError("backend", "a backend name (str)", repr(backend))
    backend = canonical_name(backend)  # "FA3" is "fa3"
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
    return AutoOptions if backend == AUTO else lookup(backend).options_model()
