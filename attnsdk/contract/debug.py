"""``ATTNSDK_DEBUG``: the environment's switch for debug mode, read by any layer.

Debug mode itself (every plan and forward validated) is ``selection.debug``; kernels that can
afford a check only when it is on (``merge_states`` reading lse values on CUDA) ask here.
"""

from __future__ import annotations

import os

from attnsdk.contract.errors import InvalidInputError

__all__ = ["ENV_DEBUG", "env_debug"]

ENV_DEBUG = "ATTNSDK_DEBUG"

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def env_debug() -> bool:
    """``ATTNSDK_DEBUG`` set to 1 / true / yes / on (0 / false / no / off or unset: off;
    anything else is an error rather than a silent "off")."""
    raw = os.environ.get(ENV_DEBUG, "")
    value = raw.strip().lower()
    if value not in _ON + _OFF:
        raise InvalidInputError(
            ENV_DEBUG, f"one of {', '.join(_ON)} (on) or {', '.join(_OFF[1:])} (off)", repr(raw)
        )
    return value in _ON
