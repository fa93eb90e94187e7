"""Specification of prepare_data.py's worked-sums task (make-fewshot-sums): well-formed rows in verl's schema,
held-out problems never in training, correct ground truths and correct worked steps in the solved examples."""
import re

import pyarrow.parquet as pq
import pytest

import reward
from data import DataError, check_parquet_schema, parse_row
from tools import prepare_data
from tools.prepare_data import FEWSHOT_SUMS, make_fewshot_sums_rows, sum_steps

QUESTION = re.compile(r"What is (\d+(?: \+ \d+)+)\?")


def question_terms(text):
    """The terms of "What is 3 + 14 + 5?", read back from the text."""
    m = QUESTION.fullmatch(text)
    assert m, text
    return tuple(int(t) for t in m.group(1).split(" + "))


def check_worked_steps(terms, solution):
    """Each line adds the next term to the running total, correctly; the last line is the sum's Answer."""
    *steps, last = solution.split("\n")
    assert len(steps) == len(terms) - 1
    total = terms[0]
    for term, line in zip(terms[1:], steps):
        a, b, c = map(int, re.fullmatch(r"(\d+) \+ (\d+) = (\d+)", line).groups())
        assert (a, b) == (total, term) and c == a + b, line
        total = c
    assert last == f"Answer: {sum(terms)}" and total == sum(terms)


def test_sum_steps():
    assert sum_steps((12, 7, 30)) == "12 + 7 = 19\n19 + 30 = 49\nAnswer: 49"
    assert sum_steps((0, 5)) == "0 + 5 = 5\nAnswer: 5"
    with pytest.raises(DataError, match="at least two terms"):
        sum_steps((4,))


def test_fewshot_examples_are_worked_correctly():
    shots = prepare_data.sums_fewshot_messages()
    assert [m["role"] for m in shots] == ["user", "assistant"] * len(FEWSHOT_SUMS)
    assert {len(t) for t in FEWSHOT_SUMS} == {3, 4, 5}  # every length a question can have
    for terms, (q, a) in zip(FEWSHOT_SUMS, zip(shots[::2], shots[1::2])):
        assert question_terms(q["content"]) == terms
        check_worked_steps(terms, a["content"])
        assert reward.compute_score("math_dapo", a["content"], str(sum(terms)))["acc"]  # the verifier agrees


def test_rows_well_formed_and_ground_truth_correct():
    rows = make_fewshot_sums_rows(300, "train", seed=1, min_terms=3, max_terms=5, one_digit_prob=0.3)
    shots = prepare_data.sums_fewshot_messages()
    lengths, one_digit = set(), 0
    for i, row in enumerate(rows):
        parse_row(row, f"row {i}", "prompt")  # the trainer's own row check
        assert row["data_source"] == "math_dapo" and row["extra_info"] == {
            "split": "train", "index": i, "terms": list(question_terms(row["prompt"][-1]["content"]))}
        assert row["prompt"][:-1] == shots and row["prompt"][-1]["role"] == "user"
        terms = question_terms(row["prompt"][-1]["content"])
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(sum(terms))}
        assert all(0 <= t <= 99 for t in terms)
        lengths.add(len(terms))
        one_digit += sum(t < 10 for t in terms)
    assert lengths == {3, 4, 5}
    n_terms = sum(len(r["extra_info"]["terms"]) for r in rows)
    assert 0.2 < one_digit / n_terms < 0.4  # one_digit_prob=0.3


def test_val_disjoint_from_train_and_examples():
    train = make_fewshot_sums_rows(5000, "train", seed=0)
    val = make_fewshot_sums_rows(400, "val", seed=0)
    train_q = {r["prompt"][-1]["content"] for r in train}
    val_q = {r["prompt"][-1]["content"] for r in val}
    assert not train_q & val_q
    shot_q = {prepare_data.sums_question(t) for t in FEWSHOT_SUMS}
    assert not shot_q & (train_q | val_q)
    assert all(r["extra_info"]["split"] == "val" for r in val)
    assert len(val_q) == len(val)  # held-out problems are distinct; training ones may repeat
    with pytest.raises(DataError, match=r"found only \d+ distinct val problems of 100"):
        make_fewshot_sums_rows(100, "val", min_terms=2, max_terms=2)  # ~15 of the 100 one-digit pairs


def test_defaults_options_and_bad_input():
    rows = make_fewshot_sums_rows(100, "val", seed=3)  # the recipe's task: three or four one-digit terms
    assert {len(r["extra_info"]["terms"]) for r in rows} == {3, 4}
    assert all(max(r["extra_info"]["terms"]) < 10 for r in rows)
    rows = make_fewshot_sums_rows(50, "val", seed=3, min_terms=5, max_terms=5, one_digit_prob=0.0)
    assert all(len(r["extra_info"]["terms"]) == 5 and min(r["extra_info"]["terms"]) >= 10 for r in rows)
    assert make_fewshot_sums_rows(20, "train", seed=2) == make_fewshot_sums_rows(20, "train", seed=2)
    with pytest.raises(DataError, match="min_terms <= max_terms"):
        make_fewshot_sums_rows(5, "train", min_terms=5, max_terms=3)
    with pytest.raises(DataError, match="not a probability"):
        make_fewshot_sums_rows(5, "train", one_digit_prob=1.5)
    with pytest.raises(DataError, match="'train' or 'val'"):
        make_fewshot_sums_rows(5, "test")


def test_cli_writes_parquet(tmp_path):
    out = tmp_path / "sums"
    prepare_data.main(["make-fewshot-sums", str(out), "--train", "30", "--val", "8", "--max_terms", "5"])
    assert check_parquet_schema([str(out / "train.parquet")], "prompt") == 30
    val = pq.read_table(out / "val.parquet").to_pylist()
    assert len(val) == 8 and all(len(r["extra_info"]["terms"]) in (3, 4, 5) for r in val)
    for r in val:
        assert r["reward_model"]["ground_truth"] == str(sum(question_terms(r["prompt"][-1]["content"])))
