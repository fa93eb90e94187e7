"""trajectories.timed: each phase's wall time and its peak of the GPU allocator, nested phases included
(a fake allocator stands in for torch.cuda on the CPU)."""
import pytest

import trajectories


class FakeAllocator:
    """torch.cuda's peak tracking: allocations move `now`; the peak follows until reset to `now`."""

    def __init__(self):
        self.now = self.peak = 0

    def alloc(self, nbytes):
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.now


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(trajectories, "_gpu_allocator", lambda: fake)
    return fake


GiB = 2**30


def test_each_phase_gets_its_own_peak(gpu):
    """A phase's peak is what it reached, not an earlier phase's: the allocator's peak is reset at its start."""
    timing = {}
    with trajectories.timed("gen", timing):
        gpu.alloc(30 * GiB)
        gpu.alloc(-30 * GiB)
    with trajectories.timed("update_actor", timing):
        gpu.alloc(10 * GiB)
        gpu.alloc(-5 * GiB)
    assert timing["peak_gib"] == {"gen": 30.0, "update_actor": 10.0}
    assert timing["gen"] >= 0 and timing["update_actor"] >= 0


def test_nested_phase_keeps_the_outer_peak(gpu):
    """An inner phase resets the allocator's peak; the outer phase's figure still covers what it reached before
    and inside the inner one."""
    timing = {}
    with trajectories.timed("old_log_prob", timing):
        gpu.alloc(20 * GiB)
        gpu.alloc(-15 * GiB)  # the outer peak (20) happens before the inner phase
        with trajectories.timed("ref", timing):
            gpu.alloc(8 * GiB)  # 13 GiB: the inner peak
            gpu.alloc(-8 * GiB)
        gpu.alloc(1 * GiB)
    assert timing["peak_gib"]["ref"] == 13.0
    assert timing["peak_gib"]["old_log_prob"] == 20.0
    assert trajectories._open_peaks == []


def test_inner_peak_reaches_the_outer_phase(gpu):
    timing = {}
    with trajectories.timed("outer", timing):
        with trajectories.timed("inner", timing):
            gpu.alloc(7 * GiB)
            gpu.alloc(-7 * GiB)
    assert timing["peak_gib"] == {"inner": 7.0, "outer": 7.0}


def test_repeated_phase_keeps_its_largest_and_sums_time(gpu):
    """wake_sleep runs twice a step: its seconds add up, its peak is the larger one."""
    timing = {}
    for nbytes in (3 * GiB, 9 * GiB, 4 * GiB):
        with trajectories.timed("wake_sleep", timing):
            gpu.alloc(nbytes)
            gpu.alloc(-nbytes)
    assert timing["peak_gib"] == {"wake_sleep": 9.0}


def test_an_exception_closes_the_phase(gpu):
    timing = {}
    with pytest.raises(RuntimeError):
        with trajectories.timed("gen", timing):
            gpu.alloc(GiB)
            raise RuntimeError("out of memory")
    assert trajectories._open_peaks == []
    assert timing["peak_gib"] == {"gen": 1.0}


def test_no_gpu_no_peaks(monkeypatch):
    """Without a GPU allocator in use (the CPU) timing holds seconds only."""
    monkeypatch.setattr(trajectories, "_gpu_allocator", lambda: None)
    timing = {}
    with trajectories.timed("gen", timing):
        pass
    assert set(timing) == {"gen"}
