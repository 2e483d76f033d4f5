"""The case record and the one assertion of the bad-input matrix (tests/*/test_*bad_input*.py).

A case is a zero-argument call that must be refused: by exactly ``error`` (an ``AttnSDKError``
subclass; any other exception escapes ``pytest.raises`` and fails the test), naming ``field``,
and leaving every tensor in ``watch`` (KV caches, engine buffers, static graph buffers) bit for
bit as it was.

How the field is named depends on the error: ``InvalidInputError`` / ``InvalidMetadataError``
carry it in ``.field`` (compared exactly; the message starts with ``"<field>: expected "``);
an ``UnsupportedConfigError`` carries it as a reason's ``.field``, or names it in its message,
and then ``match`` must also be found there, so a field word that merely occurs in the prose
does not pass for a named field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch

from attnsdk import AttnSDKError, InvalidInputError, InvalidMetadataError, UnsupportedConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["Case", "assert_refused", "params"]


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], object]
    error: type[AttnSDKError]
    field: str
    watch: tuple[torch.Tensor, ...] = ()
    """Tensors the refused call must leave untouched (compared byte for byte)."""
    match: str | None = None
    """A regex the message must contain as well (required when the field is only in prose)."""


def params(cases: Sequence[Case]) -> list[object]:
    ids = [c.id for c in cases]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"duplicate case ids: {duplicates}"
    return [pytest.param(c, id=c.id) for c in cases]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().contiguous().reshape(-1).view(torch.uint8)


def assert_refused(case: Case) -> None:
    before = [_bits(t) for t in case.watch]
    with pytest.raises(AttnSDKError) as info:
        case.call()
    exc = info.value
    assert type(exc) is case.error, (
        f"expected {case.error.__name__}, got {type(exc).__name__}: {exc}"
    )
    message = str(exc)
    if isinstance(exc, (InvalidInputError, InvalidMetadataError)):
        assert exc.field == case.field, f"names {exc.field!r}, not {case.field!r}: {exc}"
        assert message.startswith(f"{case.field}: expected "), message
        assert exc.expected, message
    elif isinstance(exc, UnsupportedConfigError):
        fields = [r.field for r in exc.reasons]
        if case.field not in fields:
            assert case.field in message, f"{case.field!r} in neither {fields} nor: {message}"
            assert case.match is not None, f"{case.field!r} only in the prose: give a match"
    if case.match is not None:
        assert re.search(case.match, message), f"{case.match!r} not in: {message}"
    for t, old in zip(case.watch, before):
        assert torch.equal(_bits(t), old), f"{case.id}: a watched tensor was written"
