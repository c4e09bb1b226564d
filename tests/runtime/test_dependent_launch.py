"""Dependent launches (runtime/kernels/backend.py ``dependent_launch``): on by default wherever the device can,
off with ``REPACK_DEPENDENT_LAUNCH=0``, never where it cannot (the CPU's interpreter here)."""

from __future__ import annotations

import pytest
import torch

from repack.runtime.kernels import backend, common


@pytest.mark.parametrize(("setting", "expected"), [(None, True), ("1", True), ("0", False)])
def test_the_switch_on_a_device_that_can(monkeypatch, setting, expected):
    monkeypatch.setattr(backend, "_launches_dependents", lambda device: True)
    if setting is None:
        monkeypatch.delenv(backend.DEPENDENT_LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(backend.DEPENDENT_LAUNCH_ENV, setting)
    device = torch.device("cuda", 0)
    assert backend.dependent_launch(device) is expected
    assert common.dependent_launches(device) == dict(DEPENDENT=expected, launch_pdl=expected)


def test_never_on_the_interpreter(monkeypatch):
    monkeypatch.setenv(backend.DEPENDENT_LAUNCH_ENV, "1")
    assert not backend.dependent_launch(torch.device("cpu"))
