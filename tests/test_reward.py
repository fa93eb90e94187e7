"""Specification of reward.py: verl's rule verifiers, custom reward functions, the overlong penalty,
and the worker pool that scores a batch with a per-call timeout. Expected values are written by hand;
cases marked "verl:" were checked against verl's reward_score/math_dapo.py or gsm8k.py source."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import reward
from reward import (GSM8K_ANSWER, RewardError, RewardScorer, ScoringStopped, arith_score, check_data_sources,
                    compute_score, gsm8k_score, load_reward_fn, math_dapo_score, normalize_final_answer,
                    normalize_result, overlong_penalty)


# -----------------------------------------------------------------------------
# DAPO math: normalization (verl's normalize_final_answer)

@pytest.mark.parametrize("raw, expected", [
    ("5 dollars", "5"),                       # spaces dropped, then the unit word removed
    ("10 cm", "10"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("\\$5", "5"),                            # escaped dollar sign
    ("3 \\text{ cm}^2", "3"),                 # verl: "\text{cm}" -> "\text{}" after "cm" removal, then "\text{}^2" removed
    ("\\text{east}", "east"),                 # \text{...} unwrapped
    ("\\textbf{7}", "7"),
    ("\\overline{3}", "3"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # \boxed unwraps to the last '}' (greedy)
    ("$\\boxed{14}$", "14"),
    ("\\frac12", "\\frac{1}{2}"),             # \fracab -> \frac{a}{b}
    ("\\frac123", "\\frac{1}{2}3"),           # \fracabc -> \frac{a}{b}c
    ("\\frac{12}{5}", "\\frac{12}{5}"),       # braces already there: untouched
    ("\\sqrt2", "\\sqrt{2}"),                 # \sqrta -> \sqrt{a}
    ("\\sqrt23", "\\sqrt{2}3"),
    ("1,000", "1000"),                        # commas dropped in pure numbers
    ("1, 2", "12"),                           # verl: space removal first, so a pair of digits becomes one number
    ("(1,2)", "(1,2)"),                       # not a pure number: commas kept
    ("x = 5", "5"),                           # only the text after the last '='
    ("a=b=7", "7"),
    ("The answer is $5$ apples", "5"),        # verl: only the first $...$ span survives
    ("\\frac{1}{2}.", "\\frac{1}{2}."),       # a trailing period is kept (only '.$' is dropped)
    ("\\frac{1}{2}.$", "\\frac{1}{2}"),
    ("[INVALID]", "[INVALID]"),
])
def test_normalize_final_answer(raw, expected):
    assert normalize_final_answer(raw) == expected


# -----------------------------------------------------------------------------
# DAPO math: extraction and score

def test_math_dapo_correct_and_wrong():
    assert math_dapo_score("Let me think.\nAnswer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert math_dapo_score("Let me think.\nAnswer: 41", "42") == {"score": -1.0, "acc": False, "pred": "41"}


def test_math_dapo_normalizes_both_sides():
    assert math_dapo_score("Answer: \\frac12", "\\frac{1}{2}")["acc"]
    assert math_dapo_score("Answer: $\\boxed{1,000}$ dollars", "1000")["acc"]
    assert math_dapo_score("Answer: x = 3", "3")["pred"] == "3"


def test_math_dapo_answer_is_case_insensitive():
    assert math_dapo_score("answer: 7", "7")["acc"]
    assert math_dapo_score("ANSWER : 7", "7")["acc"]


def test_math_dapo_last_answer_wins():
    assert math_dapo_score("Answer: 3\nwait, no.\nAnswer: 4", "4") == {"score": 1.0, "acc": True, "pred": "4"}
    assert math_dapo_score("Answer: 4\nAnswer: 3", "4")["pred"] == "3"


def test_math_dapo_answer_runs_to_end_of_line():
    # [^\n]+ takes the rest of the line, so trailing prose is part of the answer
    assert math_dapo_score("Answer: 4 because 2+2\n", "4")["pred"] == "4because2+2"


def test_math_dapo_only_last_300_characters():
    tail = "\n" + "y" * 289  # "Answer: 42" + tail is exactly 300 characters: still seen
    assert math_dapo_score("Answer: 42" + tail, "42")["acc"]
    # one more character and the window starts at "nswer: 42": no match -> invalid
    assert math_dapo_score("Answer: 42" + tail + "y", "42") == {"score": -1.0, "acc": False, "pred": None}
    assert math_dapo_score("x" * 5000 + "\nAnswer: 42", "42")["acc"]


def test_math_dapo_no_answer_is_invalid():
    assert math_dapo_score("The result is 42.", "42") == {"score": -1.0, "acc": False, "pred": None}
    assert math_dapo_score("", "42") == {"score": -1.0, "acc": False, "pred": None}


def test_strict_box_verify():
    assert math_dapo_score("so \\boxed{42}", "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    assert math_dapo_score("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", strict_box_verify=True)["acc"]  # nested braces
    assert math_dapo_score("\\boxed{1} or \\boxed{2}", "2", strict_box_verify=True)["pred"] == "2"  # last box
    # verl: the boxed content is compared raw, without normalization
    assert math_dapo_score("\\boxed{ 42}", "42", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": " 42"}
    # verl (current main): no box -> pred None; only the last 100 characters are searched
    assert math_dapo_score("\\boxed{42}" + "y" * 91, "42", strict_box_verify=True)["pred"] is None
    assert math_dapo_score("\\boxed{42}" + "y" * 90, "42", strict_box_verify=True)["acc"]  # 100 exactly
    assert math_dapo_score("\\boxed{42", "42", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}


# -----------------------------------------------------------------------------
# GSM8K (verl's gsm8k.py: 1.0 correct, format_score 0.0 wrong, 0.0 nothing found)

def test_gsm8k_strict():
    assert gsm8k_score("She pays 8*9 = 72.\n#### 72", "72") == {"score": 1.0, "acc": True, "pred": "72"}
    assert gsm8k_score("#### 1,234", "1234")["acc"]  # commas removed
    assert gsm8k_score("#### -3", "-3")["acc"]
    assert gsm8k_score("#### 3\nno wait\n#### 4", "4")["pred"] == "4"  # verl (current main): last match
    assert gsm8k_score("#### 71", "72") == {"score": 0.0, "acc": False, "pred": "71"}
    assert gsm8k_score("The answer is 72", "72") == {"score": 0.0, "acc": False, "pred": None}
    assert gsm8k_score("####72", "72")["pred"] is None  # the space after #### is required


def test_gsm8k_only_last_300_characters():
    assert gsm8k_score("#### 72\n" + "y" * 292, "72")["acc"]  # 300 characters in all
    assert gsm8k_score("#### 72\n" + "y" * 293, "72")["pred"] is None  # '#' falls out of the window


def test_gsm8k_flexible():
    assert gsm8k_score("so she has 72 apples", "72", method="flexible") == {"score": 1.0, "acc": True, "pred": "72"}
    assert gsm8k_score("from 5 to 9", "5", method="flexible")["pred"] == "9"  # last number
    # verl: the number pattern includes '.' and ',' so a sentence-final period stays attached
    assert gsm8k_score("she has 72.", "72", method="flexible") == {"score": 0.0, "acc": False, "pred": "72."}
    assert gsm8k_score("no digits", "72", method="flexible") == {"score": 0.0, "acc": False, "pred": None}


# -----------------------------------------------------------------------------
# the CPU demo's arithmetic task

def test_arith_score():
    assert arith_score("Answer: 85", "85") == {"score": 1.0, "acc": True, "pred": "85"}
    assert arith_score("answer: -3", "-3") == {"score": 1.0, "acc": True, "pred": "-3"}
    assert arith_score("Answer: 84", "85") == {"score": -1.0, "acc": False, "pred": "84"}
    assert arith_score("Answer: 1\nAnswer: 85", "85")["acc"]  # last match wins
    assert arith_score("85", "85") == {"score": -1.0, "acc": False, "pred": None}  # no Answer:
    assert arith_score("Answer: 85 apples", "85") == {"score": -1.0, "acc": False, "pred": None}  # not an integer


# -----------------------------------------------------------------------------
# dispatch by data_source

@pytest.mark.parametrize("data_source, response, ground_truth, expected_score", [
    ("math_dapo", "Answer: 7", "7", 1.0),
    ("math", "Answer: 7", "7", 1.0),
    ("aime2024", "Answer: 6", "7", -1.0),
    ("aime25", "Answer: 7", "7", 1.0),
    ("openai/gsm8k", "#### 7", "7", 1.0),
    ("gsm8k", "Answer: 7", "7", 0.0),  # GSM8K is strict '####': no number found -> 0
    ("arith", "Answer: 85", 85, 1.0),  # a number ground truth is compared as its string
])
def test_compute_score_dispatch(data_source, response, ground_truth, expected_score):
    result = compute_score(data_source, response, ground_truth)
    assert result["score"] == expected_score and result["acc"] == (expected_score == 1.0)


def test_compute_score_ground_truth_list():
    assert compute_score("math_dapo", "Answer: 0.5", ["\\frac{1}{2}", "0.5"]) == {"score": 1.0, "acc": True, "pred": "0.5"}
    assert compute_score("math_dapo", "Answer: 2", np.array(["1", "3"]))["score"] == -1.0  # parquet list column
    assert compute_score("gsm8k", "#### 9", ["8", "9"])["acc"]


def test_compute_score_unknown_data_source():
    with pytest.raises(ValueError) as e:
        compute_score("my_dataset", "Answer: 1", "1")
    msg = str(e.value)
    for needed in ["'my_dataset'", "math_dapo", "aime", "openai/gsm8k", "arith", 'reward_fn = "path/to/file.py:function_name"']:
        assert needed in msg


# -----------------------------------------------------------------------------
# overlong penalty (DAPO recipe: max 20480, buffer 4096, factor 1.0)

@pytest.mark.parametrize("length, expected", [
    (100, 0.0),
    (16383, 0.0),
    (16384, 0.0),               # expected length = 20480 - 4096: no penalty yet
    (16385, -1 / 4096),
    (18432, -0.5),              # halfway through the buffer
    (20479, -4095 / 4096),
    (20480, -1.0),              # at max_response_length: -factor
])
def test_overlong_penalty_recipe(length, expected):
    assert overlong_penalty(length, 20480, 4096, 1.0) == expected


def test_overlong_penalty_factor_and_full_buffer():
    assert overlong_penalty(20480, 20480, 4096, 0.5) == -0.5
    assert overlong_penalty(6, 8, 4, 2.0) == -1.0  # (6 - 4) / 4 * 2
    assert overlong_penalty(0, 4096, 4096, 1.0) == 0.0  # buffer == max is allowed: starts at length 0
    assert overlong_penalty(1024, 4096, 4096, 1.0) == -0.25


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="overlong_buffer_len=5000.*max_response_length=4096"):
        overlong_penalty(10, 4096, 5000, 1.0)
    with pytest.raises(ValueError, match="overlong_buffer_len=0 must be > 0"):
        overlong_penalty(10, 4096, 0, 1.0)


# -----------------------------------------------------------------------------
# custom reward functions

CUSTOM = '''
import os, time
THRESHOLD = 3

def length_reward(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))

def dict_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": -0.5, "acc": solution_str == ground_truth, "pred": solution_str.upper()}

def returns_none(data_source, solution_str, ground_truth, extra_info=None):
    return None

def exact(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(100)
    if solution_str == "boom":
        raise ZeroDivisionError("division by zero in my grader")
    if solution_str == "die":
        os._exit(3)
    return 1.0 if solution_str == ground_truth else 0.0
'''


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def test_load_reward_fn_default_and_custom(custom_file):
    assert load_reward_fn(None) is compute_score
    fn = load_reward_fn(f"{custom_file}:length_reward")
    assert fn("x", "abc", "1") == 3.0
    assert normalize_result(fn("x", "abc", "1"), "length_reward") == {"score": 3.0, "acc": True, "pred": None}
    fn = load_reward_fn(f"{custom_file}:dict_reward")
    assert normalize_result(fn("x", "ok", "ok"), "dict_reward") == {"score": -0.5, "acc": True, "pred": "OK"}


def test_load_reward_fn_errors(custom_file, tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_reward_fn(f"{tmp_path}/missing.py:fn")
    with pytest.raises(ValueError, match="no function 'nope'.*length_reward"):
        load_reward_fn(f"{custom_file}:nope")
    with pytest.raises(ValueError, match=r"'THRESHOLD' is not callable \(type int\)"):
        load_reward_fn(f"{custom_file}:THRESHOLD")
    with pytest.raises(ValueError, match="path/to/file.py:function_name"):
        load_reward_fn(custom_file)  # no ':function_name'


@pytest.mark.parametrize("result, expected", [
    (0.25, {"score": 0.25, "acc": True, "pred": None}),
    (0, {"score": 0.0, "acc": False, "pred": None}),       # acc = score > 0 when not given
    (-1, {"score": -1.0, "acc": False, "pred": None}),
    (True, {"score": 1.0, "acc": True, "pred": None}),
    (np.float32(0.5), {"score": 0.5, "acc": True, "pred": None}),
    ({"score": 0.0, "acc": True}, {"score": 0.0, "acc": True, "pred": None}),  # acc given: used as is
    ({"score": 1, "pred": "7", "extra": 3}, {"score": 1.0, "acc": True, "pred": "7"}),
])
def test_normalize_result(result, expected):
    out = normalize_result(result, "my_fn")
    assert out == expected and type(out["score"]) is float and type(out["acc"]) is bool


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), "1.0", {"acc": True}, {"score": None}, [1.0]])
def test_normalize_result_rejects(bad):
    with pytest.raises(RewardError, match="reward function my_fn returned .*should return a finite number"):
        normalize_result(bad, "my_fn")
    assert issubclass(RewardError, ValueError)


# -----------------------------------------------------------------------------
# RewardScorer: worker processes, order, timeouts, errors

def test_scorer_builtin_results_in_order():
    items = [("math_dapo", "Answer: 1", "1", None), ("gsm8k", "#### 2", "3", None),
             ("arith", "Answer: 3", "3", {"index": 2}), ("aime", "no answer", "4", None)] * 5
    expected = [{"score": 1.0, "acc": True, "pred": "1"}, {"score": 0.0, "acc": False, "pred": "2"},
                {"score": 1.0, "acc": True, "pred": "3"}, {"score": -1.0, "acc": False, "pred": None}] * 5
    for num_workers in (0, 2):
        with RewardScorer(num_workers=num_workers) as scorer:
            for _ in range(2):  # workers are reused across batches
                assert scorer.score(items) == (expected, {"num_timeouts": 0, "num_errors": 0})
            assert scorer.score([]) == ([], {"num_timeouts": 0, "num_errors": 0})


def test_scorer_custom_fn_timeout(custom_file):
    # one worker and 12 items -> chunks of 3; the hanging item sits mid-chunk, so the rest is requeued
    answers = ["a", "b", "c", "d", "hang", "f", "g", "h", "i", "j", "k", "l"]
    items = [("my_data", s, "c" if s == "c" else "z", None) for s in answers]
    with RewardScorer(f"{custom_file}:exact", num_workers=1, timeout_s=1.0) as scorer:
        start = time.monotonic()
        results, stats = scorer.score(items)
        assert time.monotonic() - start < 6.0
        assert stats == {"num_timeouts": 1, "num_errors": 0}
        assert [r["score"] for r in results] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        assert results[4] == {"score": 0.0, "acc": False, "pred": None}
        assert scorer.score([("my_data", "x", "x", None)]) == ([{"score": 1.0, "acc": True, "pred": None}],
                                                              {"num_timeouts": 0, "num_errors": 0})


def test_scorer_custom_fn_raises_on_every_response(custom_file):
    items = [("my_data", "ok", "ok", None), ("my_data", "boom", "x", None)]
    for num_workers in (0, 2):
        with RewardScorer(f"{custom_file}:exact", num_workers=num_workers) as scorer:
            with pytest.raises(RewardError) as e:
                scorer.score(items[1:] * 2)  # every response failed: the function is broken
            for needed in ["exact", "ZeroDivisionError", "division by zero in my grader", "'my_data'", "num_workers=0"]:
                assert needed in str(e.value)
            assert scorer.score(items[:1])[0] == [{"score": 1.0, "acc": True, "pred": None}]  # still usable


def test_scorer_bad_return_and_dead_worker(custom_file):
    with RewardScorer(f"{custom_file}:returns_none", num_workers=1) as scorer:
        with pytest.raises(RewardError, match="returns_none returned None.*'score'"):
            scorer.score([("my_data", "x", "x", None)])
    with RewardScorer(f"{custom_file}:exact", num_workers=1) as scorer:  # a worker that dies scores 0
        results, stats = scorer.score([("d", "die", "die", None), ("d", "y", "y", None)])
        assert [r["score"] for r in results] == [0.0, 1.0] and stats == {"num_timeouts": 0, "num_errors": 1}


def test_scorer_bad_spec_fails_at_start():
    with pytest.raises(ValueError, match="path/to/file.py:function_name"):
        RewardScorer("no_colon_here.py")


@pytest.mark.parametrize("kwargs, match", [
    ({"num_workers": -1}, "num_workers=-1 must be an integer >= 0"),
    ({"num_workers": 1.5}, "num_workers=1.5 must be an integer >= 0"),
    ({"timeout_s": 0}, "timeout_s=0 must be a finite number of seconds > 0"),
    ({"timeout_s": -2.0}, "timeout_s=-2.0 must be"),
    ({"timeout_s": float("inf")}, "timeout_s=inf must be"),
])
def test_scorer_rejects_bad_knobs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardScorer(**kwargs)


# -----------------------------------------------------------------------------
# checks before any work: data sources, GSM8K's answer pattern, reward files that do not import

def test_check_data_sources():
    check_data_sources({"math_dapo", "aime2025", "openai/gsm8k", "gsm8k", "arith"}, None)  # all built in
    check_data_sources({"my_dataset"}, "my_reward.py:grade")  # a custom function takes every data_source
    with pytest.raises(RewardError) as e:
        check_data_sources({"math_dapo", "my_b", "my_a"}, None)
    msg = str(e.value)
    assert "no verifier for data_source 'my_a', 'my_b';" in msg  # the unknown ones, and only those
    for needed in ["math_dapo", "aime*", "openai/gsm8k", "arith", 'reward_fn = "path/to/file.py:function_name"']:
        assert needed in msg


def test_gsm8k_answer_pattern_on_a_dataset_solution():
    solution = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert GSM8K_ANSWER.search(solution).group(1) == "72"
    assert GSM8K_ANSWER.search("so 1000 in all\n#### 1,000").group(1) == "1,000"  # callers drop the commas
    assert GSM8K_ANSWER.search("#### -3.5").group(1) == "-3.5"


@pytest.mark.parametrize("source, line, cause", [
    ("X = 1\ndef grade(:\n    return 1\n", 2, "SyntaxError"),
    ("import os\nimport no_such_module_for_reward_tests\n", 2,
     "ModuleNotFoundError: No module named 'no_such_module_for_reward_tests'"),
    ("X = 1\nY = X / 0\n", 2, "ZeroDivisionError: division by zero"),
])
def test_load_reward_fn_file_that_does_not_import(tmp_path, source, line, cause):
    path = tmp_path / "broken.py"
    path.write_text(source)
    for load in (load_reward_fn, RewardScorer):  # the scorer loads it in the trainer first, before any worker
        with pytest.raises(RewardError) as e:
            load(f"{path}:grade")
        msg = str(e.value)
        assert str(path) in msg and f"line {line}" in msg and cause in msg
    assert "reward_fn_broken" not in sys.modules  # no half-imported module left behind


# -----------------------------------------------------------------------------
# RewardScorer: reward functions that raise, crash their worker, or outlive the trainer

FAILING = """
import ctypes, os, signal, time

def grade(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if solution_str == "segfault":
        ctypes.string_at(0)
    if solution_str == "raise":
        raise KeyError("no such answer")
    if solution_str == "sleep":  # ground_truth: a file to create once sleeping starts
        open(ground_truth, "w").close()
        time.sleep(60)
    return 1.0
"""
FINE = ("my_data", "fine", "", None)
SCORED = {"score": 1.0, "acc": True, "pred": None}
FAILED = {"score": 0.0, "acc": False, "pred": None}


@pytest.fixture
def failing_fn(tmp_path):
    path = tmp_path / "failing.py"
    path.write_text(FAILING)
    return f"{path}:grade"


@pytest.mark.parametrize("how, exit_status", [
    ("exit", "exit code 3"), ("sigkill", "killed by signal SIGKILL"), ("segfault", "killed by signal SIGSEGV")])
def test_scorer_worker_that_dies(failing_fn, capsys, how, exit_status):
    with RewardScorer(failing_fn, num_workers=1) as scorer:
        results, stats = scorer.score([FINE, ("my_data", how, "", None), FINE])
        assert results == [SCORED, FAILED, SCORED] and stats == {"num_timeouts": 0, "num_errors": 1}
        warning = capsys.readouterr().err
        assert warning.count("warning:") == 1  # one line per call
        assert "1 of 3 responses scored 0" in warning and exit_status in warning
        with pytest.raises(RewardError) as e:  # every response failed: the function is broken
            scorer.score([("my_data", how, "", None)] * 2)
        assert failing_fn in str(e.value) and exit_status in str(e.value)
        assert scorer.score([FINE]) == ([SCORED], {"num_timeouts": 0, "num_errors": 0})  # replaced workers work


def test_scorer_exception_on_one_response(failing_fn, capsys):
    path = failing_fn.rsplit(":", 1)[0]
    line = FAILING.splitlines().index('        raise KeyError("no such answer")') + 1
    for num_workers in (0, 2):
        with RewardScorer(failing_fn, num_workers=num_workers) as scorer:
            results, stats = scorer.score([FINE, ("my_data", "raise", "", None), FINE, FINE])
        assert results == [SCORED, FAILED, SCORED, SCORED] and stats == {"num_timeouts": 0, "num_errors": 1}
        warning = capsys.readouterr().err
        assert "1 of 4 responses scored 0" in warning and "KeyError: 'no such answer'" in warning
        assert f"{path}:{line} in grade" in warning and "data_source='my_data'" in warning


def test_scorer_a_minority_of_timeouts_does_not_raise(failing_fn, tmp_path):
    with RewardScorer(failing_fn, num_workers=1, timeout_s=0.5) as scorer:
        results, stats = scorer.score([FINE, ("my_data", "sleep", str(tmp_path / "started"), None), FINE])
    assert results == [SCORED, FAILED, SCORED] and stats == {"num_timeouts": 1, "num_errors": 0}


def _running(pid: int) -> bool:
    """Whether pid is a live process; a zombie (exited, waiting for whoever adopted it to reap it) is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


TRAINER = """
import sys
sys.path.insert(0, {repo!r})
from reward import RewardScorer
scorer = RewardScorer({spec!r}, num_workers=2, timeout_s=60)
print(*[w.proc.pid for w in scorer.workers], flush=True)
scorer.score([("my_data", "sleep", {started!r} + str(i), None) for i in range(2)])
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_workers_die_when_the_trainer_is_sigkilled(failing_fn, tmp_path):
    started = str(tmp_path / "started")
    code = TRAINER.format(repo=os.path.dirname(reward.__file__), spec=failing_fn, started=started)
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(workers) == 2
        # both workers are inside the reward function
        assert _wait_until(lambda: all(os.path.exists(started + str(i)) for i in range(2)), 30.0)
    finally:
        trainer.kill()
        trainer.wait()
    assert _wait_until(lambda: not any(_running(pid) for pid in workers), 3.0)


ORPHAN = """
import subprocess, sys
watched = (
    "import os, sys, threading, time; sys.path.insert(0, {repo!r}); import reward; "
    "threading.Thread(target=reward._watch_parent, args=(os.getppid(),), daemon=True).start(); "
    "print('watching', flush=True); time.sleep(60)")
child = subprocess.Popen([sys.executable, "-c", watched])
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_watchdog_alone_ends_an_orphaned_worker():
    # the same as above without the parent-death signal, as on systems without prctl
    code = ORPHAN.format(repo=os.path.dirname(reward.__file__))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "watching"
        assert _running(child)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_until(lambda: not _running(child), 3.0)


def test_kill_and_close_stop_the_workers_at_once(failing_fn):
    scorer = RewardScorer(failing_fn, num_workers=2)
    workers = [w.proc.pid for w in scorer.workers]
    start = time.monotonic()
    scorer.kill()  # what a second Ctrl-C calls before os._exit
    assert _wait_until(lambda: not any(_running(pid) for pid in workers), 1.0)
    scorer.close()
    scorer.close()
    assert time.monotonic() - start < 2.0
    with pytest.raises(RuntimeError, match="after close"):
        scorer.score([FINE])


def test_workers_ignore_sigterm():
    # under torchrun the launcher's SIGTERM reaches the whole process group; the trainer closes its workers
    item = ("arith", "Answer: 3", "3", None)
    with RewardScorer(num_workers=1) as scorer:
        assert scorer.score([item]) == ([{"score": 1.0, "acc": True, "pred": "3"}],
                                        {"num_timeouts": 0, "num_errors": 0})
        pid = scorer.workers[0].proc.pid
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.2)  # time for the signal to land
        assert scorer.score([item] * 3) == ([{"score": 1.0, "acc": True, "pred": "3"}] * 3,
                                            {"num_timeouts": 0, "num_errors": 0})
        assert scorer.workers[0].proc.pid == pid and _running(pid)


SLOW = """
import time

def grade(data_source, solution_str, ground_truth, extra_info=None):
    if "slow" in solution_str:
        time.sleep(float(ground_truth))
    return float(len(solution_str))
"""


@pytest.fixture
def slow_fn(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text(SLOW)
    return f"{path}:grade"


def test_scorer_timeouts_are_reported(slow_fn, capsys):
    long_solution = "slow " + "x" * 100
    items = [("fast_data", "a", "0", None), ("slow_data", long_solution, "60", None),
             ("fast_data", "bb", "0", None)]
    with RewardScorer(slow_fn, num_workers=1, timeout_s=0.3) as scorer:
        results, stats = scorer.score(items)
        assert [r["score"] for r in results] == [1.0, 0.0, 2.0]
        assert stats == {"num_timeouts": 1, "num_errors": 0}
        warning = capsys.readouterr().err
        assert warning.count("warning:") == 1 and warning.count("\n") == 1  # one line per call
        for needed in ["1 of 3 responses", "reward_timeout=0.3 s", slow_fn, "data_source='slow_data'",
                       repr(long_solution[:60])]:
            assert needed in warning
        assert long_solution[:61] not in warning
        scorer.score(items[:1])
        assert capsys.readouterr().err == ""  # no timeouts, no warning


def test_scorer_most_responses_timing_out_raise(slow_fn):
    items = [("my_data", "slow", "60", None)] * 3 + [("my_data", "fast", "0", None)]  # the fast one scores
    with RewardScorer(slow_fn, num_workers=1, timeout_s=0.3) as scorer:
        with pytest.raises(RewardError) as e:
            scorer.score(items)
        msg = str(e.value)
        for needed in [slow_fn, "reward_timeout=0.3 s", "3 of 4 responses", "data_source='my_data'",
                       "Raise reward_timeout", "num_workers=0"]:
            assert needed in msg
        assert scorer.score([("my_data", "ok", "0", None)])[0] == [{"score": 2.0, "acc": True, "pred": None}]


def test_scorer_function_that_always_hangs_fails_fast(slow_fn):
    # waiting out every response would take 40 * 0.3 s / 2 workers; it stops after max(4, 2 * 2) timeouts
    with RewardScorer(slow_fn, num_workers=2, timeout_s=0.3) as scorer:
        with pytest.raises(RewardError) as e:
            scorer.score([("my_data", f"slow {i}", "60", None) for i in range(40)])
        msg = str(e.value)
        found = re.search(r"on (\d+) of the 40 responses of this call before scoring any", msg)
        timed_out = int(found.group(1))
        assert timed_out == 4 and "reward_timeout=0.3 s" in msg and slow_fn in msg
        # busy workers were replaced: none of the abandoned responses reaches the next call
        assert scorer.score([("my_data", "a", "0", None), ("my_data", "bb", "0", None)]) == (
            [{"score": 1.0, "acc": True, "pred": None}, {"score": 2.0, "acc": True, "pred": None}],
            {"num_timeouts": 0, "num_errors": 0})


@pytest.mark.parametrize("num_workers", [0, 1])
def test_scorer_should_stop_abandons_the_call(slow_fn, num_workers):
    assert not issubclass(ScoringStopped, ValueError)  # not a RewardError: nothing is wrong with the function
    with RewardScorer(slow_fn, num_workers=num_workers) as scorer:
        scorer.score([("my_data", "a", "0", None)])  # with workers: they are up before the clock starts
        start, polls = time.monotonic(), []

        def should_stop():
            polls.append(time.monotonic() - start)
            return polls[-1] > 0.3

        with pytest.raises(ScoringStopped):
            scorer.score([("my_data", "slow", "0.5", None)] * 20, should_stop=should_stop)
        assert [p > 0.3 for p in polls].count(True) == 1 and polls[-1] > 0.3  # stopped at the first True
        # the abandoned responses (score 4.0) never reach the next call
        assert scorer.score([("my_data", "a", "0", None), ("my_data", "bb", "0", None)]) == (
            [{"score": 1.0, "acc": True, "pred": None}, {"score": 2.0, "acc": True, "pred": None}],
            {"num_timeouts": 0, "num_errors": 0})
