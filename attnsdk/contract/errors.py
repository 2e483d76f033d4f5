"""The exceptions attnsdk raises, and ``Reason``: one reason a backend cannot serve a request.

::

    AttnSDKError                              base of everything attnsdk raises on purpose
     ├── UnsupportedConfigError(ValueError)   a backend cannot serve this config; carries .reasons
     ├── BackendUnavailableError(ImportError) a kernel library is missing; names .install_command
     ├── InvalidMetadataError(ValueError)     AttentionMetadata breaks an invariant; names .field
     └── InvalidInputError(ValueError)        a tensor handed to the SDK has the wrong shape/dtype/...

Every message names the field, what was expected and what was found.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "AttnSDKError",
    "BackendUnavailableError",
    "InvalidInputError",
    "InvalidMetadataError",
    "Reason",
    "ReasonKind",
    "UnsupportedConfigError",
]


class AttnSDKError(Exception):
    """Base class of every error attnsdk raises on purpose."""


class UnsupportedConfigError(AttnSDKError, ValueError):
    """A backend cannot serve the requested configuration.

    ``reasons`` lists every reason, environment problems first, then configuration, then batch.
    """

    def __init__(self, message: str, reasons: Sequence[Reason] = ()) -> None:
        self.reasons: tuple[Reason, ...] = tuple(reasons)
        lines = [message, *(f"  - {r}" for r in self.reasons)]
        super().__init__("\n".join(lines))


class BackendUnavailableError(AttnSDKError, ImportError):
    """A backend's kernel library is not installed; ``install_command`` says how to get it."""

    def __init__(self, message: str, install_command: str) -> None:
        self.install_command = install_command
        super().__init__(f"{message} Install it with: {install_command}")


class _FieldError(AttnSDKError, ValueError):
    def __init__(self, field: str, expected: str, found: object, hint: str = "") -> None:
        self.field = field
        self.expected = expected
        self.found = found
        self.hint = hint
        message = f"{field}: expected {expected}, found {found}"
        if hint:
            message += f". {hint}"
        super().__init__(message)


class InvalidMetadataError(_FieldError):
    """``AttentionMetadata`` violates an invariant; ``field`` names the offending field."""


class InvalidInputError(_FieldError):
    """A tensor or argument passed to the SDK is malformed; ``field`` names the argument."""


class ReasonKind(enum.IntEnum):
    """Why a backend cannot serve a request; reasons sort in this order."""

    ENVIRONMENT = 0
    """Library not installed, no GPU, wrong compute capability."""
    CONFIGURATION = 1
    """The layer or KV layout asks for something the backend lacks."""
    BATCH = 2
    """This particular batch cannot be served."""


@dataclass(frozen=True, slots=True, order=True)
class Reason:
    """One reason a backend cannot serve a request.

    >>> str(Reason(ReasonKind.CONFIGURATION, "head_dim", "must be <= 256, found 512"))
    'configuration: head_dim must be <= 256, found 512'
    """

    kind: ReasonKind
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind.name.lower()}: {self.field} {self.message}"
