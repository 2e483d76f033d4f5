"""``DeviceFlag``: device-side errors reported on the host (the CPU half: ``check_now``)."""

from __future__ import annotations

import pytest
import torch

from attnsdk.kernels.store import DeviceFlag


def _error(value: int, when: str) -> Exception:
    return ValueError(f"bad value {value} ({when})")


def test_check_now_raises_the_largest_value_once() -> None:
    flag = DeviceFlag(torch.device("cpu"), _error)
    flag.check_now()  # -1: nothing to report
    flag.flag.copy_(torch.maximum(flag.flag, torch.tensor([7])))
    flag.flag.copy_(torch.maximum(flag.flag, torch.tensor([3])))
    with pytest.raises(ValueError, match=r"bad value 7 \(reported at once: debug mode\)"):
        flag.check_now()
    flag.check_now()  # reported once, then cleared


def test_poll_does_nothing_without_cuda_events() -> None:
    flag = DeviceFlag(torch.device("cpu"), _error)
    flag.flag.fill_(5)
    for _ in range(3 * DeviceFlag.POLL_EVERY):
        flag.poll()
    with pytest.raises(ValueError, match="bad value 5"):
        flag.check_now()
