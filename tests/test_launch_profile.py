"""benchmarks/launch_profile.py's accounting of overlapping launches: with dependent launches each kernel starts
while the one before still runs, so what a launch costs its call is the part of its span nothing earlier covers."""

from __future__ import annotations

import pytest

from benchmarks.launch_profile import exposed_times


def test_back_to_back_launches_are_exposed_whole():
    spans = [("route", 0.0, 3.0), ("w13", 3.5, 12.5), ("w2", 13.0, 20.0)]
    assert exposed_times(spans) == pytest.approx({"route": 3.0, "w13": 9.0, "w2": 7.0})


def test_a_dependent_launch_adds_only_what_outlasts_the_launch_before():
    """w13 starts 1 us into the routing and waits for it; w2 starts early too, and the next call's routing starts
    while w2 still runs: each adds only its tail, and the tails add up to the busy time."""
    spans = [("route", 0.0, 4.0), ("w13", 1.0, 14.0), ("w2", 2.0, 21.0), ("route", 20.0, 24.0)]
    exposed = exposed_times(spans)
    assert exposed == pytest.approx({"route": 4.0 + 3.0, "w13": 10.0, "w2": 7.0})
    assert sum(exposed.values()) == pytest.approx(24.0)


def test_a_launch_inside_another_adds_nothing_and_order_of_the_list_does_not_matter():
    spans = [("inner", 2.0, 5.0), ("outer", 0.0, 10.0), ("after", 10.0, 11.0), ("tie", 0.0, 1.0)]
    assert exposed_times(spans) == pytest.approx({"outer": 10.0, "inner": 0.0, "tie": 0.0, "after": 1.0})
