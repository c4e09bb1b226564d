"""benchmarks/bench_convert.py's settling before each timed step: /proc/meminfo and /proc/diskstats parsing, and
the wait for a quiet disk (fed with fake samples and a fake clock: no disk, no sleeping)."""

from __future__ import annotations

import pytest

from benchmarks import bench_convert
from benchmarks.bench_convert import diskstats_written_bytes, meminfo_dirty_bytes, wait_until_quiet

MEMINFO = """\
MemTotal:       24641772 kB
MemFree:         1203404 kB
Dirty:              2168 kB
Writeback:           512 kB
WritebackTmp:          0 kB
"""

# Linux 6.x: 17 fields after the name (discards since 4.18, flushes since 5.5); 4.18-5.4 has 15, older kernels 11.
DISKSTATS = """\
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 254       0 vda 1257760 197637 1370739402 4821116 254346 563197 501159216 2583410 0 657724 7470249 289656 58 469543008 64354 20197 1367
 254       1 vda1 100 0 800 10 200 0 4000 20 0 30 30 10 0 3000 5
 253       0 zram0 0 0 0 0 4 0 32 0 0 0 0
"""  # noqa: E501


def test_meminfo_dirty_is_dirty_plus_writeback_in_bytes() -> None:
    assert meminfo_dirty_bytes(MEMINFO) == (2168 + 512) * 1024


def test_meminfo_without_writeback_or_with_other_units_is_refused() -> None:
    with pytest.raises(ValueError, match="Writeback"):
        meminfo_dirty_bytes("Dirty:  12 kB\n")
    with pytest.raises(ValueError, match="Dirty"):
        meminfo_dirty_bytes("Dirty:  12 MB\nWriteback:  0 kB\n")


def test_diskstats_counts_written_and_discarded_sectors_of_the_device() -> None:
    assert diskstats_written_bytes(DISKSTATS, (254, 0)) == (501159216 + 469543008) * 512
    # 4.18-5.4 (no flush fields): discards still counted
    assert diskstats_written_bytes(DISKSTATS, (254, 1)) == (4000 + 3000) * 512
    # before 4.18 (no discard fields): written sectors only
    assert diskstats_written_bytes(DISKSTATS, (253, 0)) == 32 * 512


def test_diskstats_without_the_device_sums_every_device() -> None:
    every = (501159216 + 469543008 + 4000 + 3000 + 32) * 512
    assert diskstats_written_bytes(DISKSTATS, None) == every
    assert diskstats_written_bytes(DISKSTATS, (0, 42)) == every  # overlayfs, tmpfs: an anonymous device
    with pytest.raises(ValueError):
        diskstats_written_bytes("", (254, 0))


class FakeMachine:
    """A clock that advances only when slept on, and a disk that writes ``rate(t)`` bytes/s with ``dirty(t)``
    bytes dirty."""

    def __init__(self, rate, dirty=lambda t: 0) -> None:
        self.now, self.written, self.rate, self.dirty, self.syncs = 100.0, 0, rate, dirty, 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.written += int(self.rate(self.now - 100.0) * seconds)
        self.now += seconds

    def sync(self) -> None:
        self.syncs += 1

    def sample(self) -> tuple[int, int]:
        return self.dirty(self.now - 100.0), self.written

    def wait(self, **kwargs) -> bench_convert.Settle:
        return wait_until_quiet(self.sample, clock=self.clock, sleep=self.sleep, sync=self.sync, **kwargs)


def test_a_quiet_disk_settles_after_one_quiet_window() -> None:
    machine = FakeMachine(rate=lambda t: 0)
    settle = machine.wait(quiet_s=5.0, poll_s=1.0)
    assert settle.settled and settle.wait_s == 5.0 and settle.write_rate == 0
    assert machine.syncs == 6  # every poll syncs
    assert settle.cell() == "5 s"


def test_the_wait_lasts_until_writes_have_stopped_for_a_whole_window() -> None:
    machine = FakeMachine(rate=lambda t: 500 * 2**20 if t < 30 else 2**20)  # a backlog written for 30 s, then logs
    settle = machine.wait(quiet_s=5.0, poll_s=1.0, max_write_rate=4 * 2**20)
    assert settle.settled
    assert 35.0 <= settle.wait_s <= 36.0
    assert settle.write_rate <= 4 * 2**20


def test_dirty_pages_keep_it_waiting() -> None:
    machine = FakeMachine(rate=lambda t: 0, dirty=lambda t: 2**30 if t < 12 else 0)
    settle = machine.wait(quiet_s=5.0, poll_s=1.0, max_dirty_bytes=64 * 2**20)
    assert settle.settled and settle.wait_s == 12.0 and settle.dirty_bytes == 0


def test_a_disk_that_never_quiets_times_out_and_says_so() -> None:
    machine = FakeMachine(rate=lambda t: 100 * 2**20, dirty=lambda t: 200 * 2**20)
    settle = machine.wait(quiet_s=5.0, poll_s=1.0, timeout_s=20.0)
    assert not settle.settled
    assert settle.wait_s == 20.0
    assert settle.write_rate == pytest.approx(100 * 2**20)
    assert settle.cell() == "20 s, timed out (200 MiB dirty, 100.0 MiB/s)"
