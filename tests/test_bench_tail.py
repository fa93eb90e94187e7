"""bench/tail.py's statistics of a rollout's long tail, on hand-made traces, and its length draw."""
import json
import os
import subprocess
import sys

import pytest

from bench.tail import lognormal_lengths, tail_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tail_counts_the_steps_that_start_with_few_responses_decoding():
    """10 responses; the trace gives (seconds, still decoding) after each step. With below=0.3 a step counts in
    the tail when fewer than 3 responses were decoding at its start."""
    trace = [(1.0, 10), (2.0, 5), (3.0, 2), (5.0, 1), (9.0, 0)]
    s = tail_stats(trace, total=10, below=0.3)
    # steps starting with 2 (3.0 -> 5.0) and 1 (5.0 -> 9.0) decoding: 6 of 9 seconds
    assert s["tail_s"] == 6.0 and s["gen_s"] == 9.0 and s["tail_fraction"] == round(6 / 9, 4)
    assert s["half_done_s"] == 2.0  # 5 of 10 finished after the step ending at 2 s
    assert s["p90_done_s"] == 5.0  # 9 of 10 finished after the step ending at 5 s
    assert s["steps"] == 5


def test_no_tail_when_all_finish_together():
    s = tail_stats([(1.0, 8), (2.0, 8), (3.0, 0)], total=8)
    assert s["tail_s"] == 0.0 and s["tail_fraction"] == 0.0 and s["half_done_s"] == 3.0


def test_the_first_step_never_counts():
    """The first step starts with every response decoding, whatever the threshold below 1."""
    s = tail_stats([(4.0, 0)], total=3, below=0.9)
    assert s["tail_s"] == 0.0 and s["gen_s"] == 4.0


def test_empty_trace():
    assert tail_stats([], total=4)["tail_fraction"] == 0.0


def test_lognormal_lengths_are_seeded_clipped_and_centred():
    a = lognormal_lengths(4000, median=3000, sigma=0.8, cap=16384, seed=1)
    assert a == lognormal_lengths(4000, median=3000, sigma=0.8, cap=16384, seed=1)
    assert a != lognormal_lengths(4000, median=3000, sigma=0.8, cap=16384, seed=2)
    assert min(a) >= 16 and max(a) == 16384
    assert 2800 <= sorted(a)[2000] <= 3200  # the median
    # P(length >= cap) = P(z >= ln(16384 / 3000) / 0.8 = 2.12) = 1.7%
    assert 0.010 <= sum(n == 16384 for n in a) / 4000 <= 0.025


@pytest.mark.slow
def test_step_bench_runs_each_side_at_each_length(tmp_path):
    """bench/step.py --tiny on the CPU at two response lengths: one side per length, each with its steps, its
    micro-batch from --micro-batch-tokens and its phases; the probe's record of each update, the second one
    profiled."""
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, "bench/step.py", "--tiny", "--sides", "nanodapo_torch", "--response-len", "8,16",
                    "--micro-batch-tokens", "80", "--profile-update", "2", "--work", str(tmp_path / "work"),
                    "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    res = json.load(open(out))
    assert set(res["sides"]) == {"nanodapo_torch_8", "nanodapo_torch_16"}
    # 80 tokens hold two 32 + 8 trajectories, one 32 + 16
    for R, mb, side in ((8, 2, res["sides"]["nanodapo_torch_8"]), (16, 1, res["sides"]["nanodapo_torch_16"])):
        assert side["response_len"] == R and side["micro_batch"] == mb
        assert len(side["per_step"]["step"]) == 2 and side["median"]["update"] > 0
        assert side["median_steps"] == [2] and side["median"]["update"] == side["per_step"]["update"][1]
        assert side["config"]["max_response_length"] == R
        probe = side["update_probe"]
        assert [u["update"] for u in probe] == [1, 2] and ["profile" in u for u in probe] == [False, True]
        assert all(u["trajectories"] == 16 and 16 * 32 < u["tokens"] <= 16 * (32 + R) and u["wall_s"] > 0 for u in probe)
        assert probe[1]["profile"]["kernel_s"] > 0
    assert not res["errors"]
