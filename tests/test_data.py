"""Specification of data.py (verl-schema parquet in, prompt ids / index batches out; the tokenizer and its
chat template) and of prepare_data.py (the demo task, GSM8K, jsonl2parquet, inspect)."""
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import data
from data import DataError, PromptSampler, balanced_micro_batches, check_parquet_schema, load_prompts, write_parquet
from conftest import CHAT_TEMPLATE, byte_tokenizer_dir
from tools import prepare_data
from tools.prepare_data import make_arith_rows


class CharTokenizer:
    """One token per character (id = ord); template: role initial + content per message, then '>'."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(m["role"][0].upper() + m["content"] for m in messages)
        text += ">" if add_generation_prompt else ""
        return [ord(c) for c in text] if tokenize else text

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


TOK = CharTokenizer()


def ids(s):
    return [ord(c) for c in s]


def row(content, gt="1", ds="test", **extra):
    return {"data_source": ds, "prompt": [{"role": "user", "content": content}], "ability": "t",
            "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": extra or {"index": 0}}


def write(tmp_path, name, rows):
    path = str(tmp_path / name)
    write_parquet(rows, path)
    return path


def load(files, **kw):
    kw.setdefault("max_prompt_length", 100)
    return load_prompts(files, TOK, **kw)

# -----------------------------------------------------------------------------
# parquet in verl's schema

def test_round_trip_nested_schema(tmp_path):
    rows = [
        {"data_source": "math_dapo", "ability": "MATH",
         "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
         "reward_model": {"style": "rule", "ground_truth": "42"},
         "extra_info": {"split": "train", "index": 7}},
        {"data_source": "gsm8k", "ability": "math", "prompt": [{"role": "user", "content": "ab"}],
         "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"split": "train", "index": 8}},
    ]
    path = write(tmp_path, "train.parquet", rows)
    schema = pq.read_schema(path)
    assert pa.types.is_list(schema.field("prompt").type)
    assert pa.types.is_struct(schema.field("reward_model").type)
    assert pa.types.is_struct(schema.field("extra_info").type)
    items = load([path])
    assert items[0] == {"prompt_ids": ids("SsUq>"), "data_source": "math_dapo", "ground_truth": "42",
                        "extra_info": {"split": "train", "index": 7},
                        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    assert items[1]["prompt_ids"] == ids("Uab>")
    assert items[1]["data_source"] == "gsm8k"


def test_plain_string_prompt_and_list_ground_truth(tmp_path):
    # a file written by other tools: prompt is a string column, ground truth a list, no extra_info
    table = pa.table({"data_source": ["x"], "prompt": ["hi"],
                      "reward_model": [{"style": "rule", "ground_truth": ["1", "one"]}]})
    path = str(tmp_path / "s.parquet")
    pq.write_table(table, path)
    (item,) = load([path])
    assert item["messages"] == [{"role": "user", "content": "hi"}]
    assert item["prompt_ids"] == ids("Uhi>")
    assert item["ground_truth"] == ["1", "one"]
    assert item["extra_info"] == {}


def test_multiple_files_concatenate_in_order(tmp_path):
    a = write(tmp_path, "a.parquet", [row("a"), row("b")])
    b = write(tmp_path, "b.parquet", [row("c")])
    assert [it["prompt_ids"] for it in load([a, b])] == [ids("Ua>"), ids("Ub>"), ids("Uc>")]
    assert [it["prompt_ids"] for it in load([b, a])] == [ids("Uc>"), ids("Ua>"), ids("Ub>")]

# -----------------------------------------------------------------------------
# max_prompt_length: truncation, filtering, max_samples

@pytest.mark.parametrize("mode,max_len,expected", [
    # "Uabcdef>" is 8 tokens
    ("left", 3, "ef>"), ("right", 3, "Uab"), ("middle", 3, "Uf>"),   # middle: first 1 + last 2
    ("left", 4, "def>"), ("right", 4, "Uabc"), ("middle", 4, "Uaf>"),  # middle: first 2 + last 2
    ("left", 1, ">"), ("right", 1, "U"), ("middle", 1, ">"),          # middle: first 0 + last 1
    ("left", 8, "Uabcdef>"), ("middle", 9, "Uabcdef>"),               # fits: untouched
])
def test_truncation_modes(tmp_path, mode, max_len, expected):
    path = write(tmp_path, "t.parquet", [row("abcdef")])
    assert load([path], max_prompt_length=max_len, truncation=mode)[0]["prompt_ids"] == ids(expected)


def test_overlong_with_truncation_error_names_row_and_fixes(tmp_path):
    path = write(tmp_path, "long.parquet", [row("a"), row("abcdef")])
    with pytest.raises(DataError) as e:
        load([path], max_prompt_length=5)
    msg = str(e.value)
    for phrase in ["long.parquet", "row 1", "8 tokens", "max_prompt_length=5",
                   "filter_overlong_prompts=True", "truncation=left/right/middle"]:
        assert phrase in msg


def test_filter_overlong_drops_and_reports(tmp_path, capsys):
    # templated lengths 5, 8, 4, 6 with max 5: rows 1 and 3 go
    path = write(tmp_path, "f.parquet", [row("abc"), row("abcdef"), row("ab"), row("abcd")])
    items = load([path], max_prompt_length=5, filter_overlong_prompts=True)
    assert [it["prompt_ids"] for it in items] == [ids("Uabc>"), ids("Uab>")]
    assert "dropped 2 of 4" in capsys.readouterr().out


def test_filter_everything_is_an_error(tmp_path):
    path = write(tmp_path, "f.parquet", [row("abcdef")])
    with pytest.raises(DataError, match="dropped all 1"):
        load([path], max_prompt_length=3, filter_overlong_prompts=True)


def test_max_samples_counts_after_filtering(tmp_path):
    a = write(tmp_path, "a.parquet", [row("abcdef"), row("a")])
    b = write(tmp_path, "b.parquet", [row("b"), row("c")])
    items = load([a, b], max_prompt_length=5, filter_overlong_prompts=True, max_samples=2)
    assert [it["prompt_ids"] for it in items] == [ids("Ua>"), ids("Ub>")]
    assert len(load([a, b], max_samples=-1)) == 4
    assert len(load([a, b], max_samples=3)) == 3


def test_unknown_truncation_mode(tmp_path):
    path = write(tmp_path, "a.parquet", [row("a")])
    with pytest.raises(DataError, match="unknown truncation mode 'both'.*left"):
        load([path], truncation="both")

# -----------------------------------------------------------------------------
# errors on bad files and rows

def test_missing_column_names_file_column_and_fix(tmp_path):
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.table({"data_source": ["x"], "prompt": ["hi"]}), path)
    for call in (lambda: load([path]), lambda: check_parquet_schema([path])):
        with pytest.raises(DataError) as e:
            call()
        msg = str(e.value)
        assert "missing column 'reward_model'" in msg and "train.parquet" in msg
        assert "python tools/prepare_data.py jsonl2parquet" in msg


def test_custom_prompt_key(tmp_path):
    path = str(tmp_path / "q.parquet")
    pq.write_table(pa.table({"data_source": ["x"], "question": ["hi"],
                             "reward_model": [{"ground_truth": "1"}]}), path)
    assert load([path], prompt_key="question")[0]["prompt_ids"] == ids("Uhi>")
    with pytest.raises(DataError, match="missing column 'prompt'"):
        load([path])


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found: .*nope.parquet"):
        load([str(tmp_path / "nope.parquet")])


@pytest.mark.parametrize("bad,column", [
    ({"prompt": [{"role": "user"}]}, "'prompt'"),                      # no content
    ({"prompt": []}, "'prompt'"),                                      # no messages
    ({"reward_model": {"style": "rule", "ground_truth": None}}, "ground_truth"),
])
def test_malformed_row_names_file_row_column(tmp_path, bad, column):
    bad_row = {**row("b"), **bad}
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist([row("a"), bad_row]), path)
    with pytest.raises(DataError) as e:
        load([path])
    msg = str(e.value)
    assert "bad.parquet row 1" in msg and column in msg


def gt_file(tmp_path, values, arrow_type):
    path = str(tmp_path / "gt.parquet")
    rm = pa.array([{"style": "rule", "ground_truth": v} for v in values],
                  pa.struct([("style", pa.string()), ("ground_truth", arrow_type)]))
    pq.write_table(pa.table({"data_source": ["x"] * len(values), "prompt": ["p"] * len(values), "reward_model": rm}),
                   path)
    return path


@pytest.mark.parametrize("arrow_type", [pa.float64(), pa.float32()])
def test_float_ground_truths_become_strings(tmp_path, arrow_type):
    # integral -> the integer; otherwise the shortest decimal of the stored number (float32 0.1 is "0.1")
    path = gt_file(tmp_path, [85.0, 0.5, -3.0, 0.1, 2.25, 1e20], arrow_type)
    assert [it["ground_truth"] for it in load([path])] == ["85", "0.5", "-3", "0.1", "2.25",
                                                           "100000000000000000000"]


def test_int_ground_truths_become_strings(tmp_path):
    path = gt_file(tmp_path, [85, -3, 0], pa.int64())
    assert [it["ground_truth"] for it in load([path])] == ["85", "-3", "0"]


@pytest.mark.parametrize("value,arrow_type", [
    (True, pa.bool_()),
    ({"a": "1"}, pa.struct([("a", pa.string())])),
    ([1, 2], pa.list_(pa.int64())),
    ([], pa.list_(pa.string())),
    (None, pa.string()),
    (float("nan"), pa.float64()),
])
def test_other_ground_truth_types_are_rejected(tmp_path, value, arrow_type):
    path = gt_file(tmp_path, ["1", value] if arrow_type == pa.string() else [value, value], arrow_type)
    row_index = 1 if arrow_type == pa.string() else 0
    with pytest.raises(DataError) as e:
        load([path])
    msg = str(e.value)
    assert f"gt.parquet row {row_index}" in msg and "'reward_model.ground_truth'" in msg


def test_check_parquet_schema(tmp_path):
    a = write(tmp_path, "a.parquet", [row("a"), row("b")])
    b = write(tmp_path, "b.parquet", [row("c")])
    assert check_parquet_schema([a, b]) == 3

    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet is not a readable parquet file"):
        check_parquet_schema([a, str(junk)])

    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist([row("a")]).slice(0, 0), empty)
    with pytest.raises(DataError, match="empty.parquet has 0 rows"):
        check_parquet_schema([empty])

    with pytest.raises(DataError, match="no data files"):
        check_parquet_schema([])

    no_gt = str(tmp_path / "nogt.parquet")
    pq.write_table(pa.table({"data_source": ["x"], "prompt": ["p"], "reward_model": [{"style": "rule"}]}), no_gt)
    with pytest.raises(DataError, match="'reward_model' in .*nogt.parquet .*ground_truth"):
        check_parquet_schema([no_gt])

# -----------------------------------------------------------------------------
# sampler

def test_sampler_without_shuffle_walks_in_order_across_epochs():
    s = PromptSampler(5, seed=0, shuffle=False)
    assert s.next_indices(3) == [0, 1, 2]
    assert (s.epoch, s.consumed) == (0, 3)
    assert s.next_indices(4) == [3, 4, 0, 1]  # straddles the epoch boundary
    assert (s.epoch, s.consumed) == (1, 7)
    assert s.next_indices(3) == [2, 3, 4]
    assert (s.epoch, s.consumed) == (2, 10)  # epoch names where the next index comes from


def test_sampler_every_epoch_is_a_permutation_and_epochs_differ():
    s = PromptSampler(10, seed=3)
    epochs = [s.next_indices(10) for _ in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert PromptSampler(10, seed=4).next_indices(10) != epochs[0]
    assert PromptSampler(10, seed=3).next_indices(10) == epochs[0]


@pytest.mark.parametrize("first", [0, 4, 10, 13, 20])  # mid-epoch, exactly at epoch ends, straddling
def test_sampler_resume_gives_uninterrupted_order(first):
    straight = PromptSampler(10, seed=1)
    expected = straight.next_indices(first) + straight.next_indices(7) + straight.next_indices(7)

    s = PromptSampler(10, seed=1)
    got = s.next_indices(first)
    state = json.loads(json.dumps(s.state_dict()))  # plain ints survive a round trip
    resumed = PromptSampler(10, seed=999)            # the seed comes from the state
    resumed.load_state_dict(state)
    got += resumed.next_indices(7) + resumed.next_indices(7)
    assert got == expected
    assert resumed.consumed == first + 14


def test_sampler_state_at_epoch_end_resumes_at_next_epoch():
    # verl #5725: a state saved exactly at an epoch's end must not resume with zero steps
    s = PromptSampler(4, seed=0, shuffle=False)
    s.next_indices(4)
    assert s.state_dict() == {"epoch": 1, "position": 0, "seed": 0, "num_prompts": 4}
    r = PromptSampler(4, seed=0, shuffle=False)
    r.load_state_dict(s.state_dict())
    assert (r.epoch, r.consumed) == (1, 4)
    assert r.next_indices(2) == [0, 1]


def test_sampler_rejects_state_from_other_data():
    s = PromptSampler(4, seed=0)
    with pytest.raises(DataError, match="saved with 5 prompts"):
        s.load_state_dict({"epoch": 0, "position": 1, "seed": 0, "num_prompts": 5})

# -----------------------------------------------------------------------------
# token-budget micro-batching

def check_packing(lengths, mbs, max_token_len):
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    assert all(mb == sorted(mb) and mb for mb in mbs)
    assert all(sum(lengths[i] for i in mb) <= max_token_len for mb in mbs)


@pytest.mark.parametrize("lengths,max_len,expected", [
    ([3, 3, 3, 3], 12, [[0, 1, 2, 3]]),          # all fit in one
    ([5, 5, 5, 5], 10, [[0, 2], [1, 3]]),        # 20 tokens / 10 -> 2
    ([6, 6, 6], 10, [[0], [1], [2]]),            # no two fit together
    ([7, 3, 6, 4], 10, [[0, 1], [2, 3]]),        # 7+3 and 6+4
    ([7, 7, 6], 10, [[0], [1], [2]]),            # ceil(20/10) = 2 cannot fit: grow to 3
    ([2, 9, 1], 10, [[1], [0, 2]]),              # 9 | 2+1: heaviest micro-batch first
])
def test_micro_batches_minimal_count(lengths, max_len, expected):
    mbs = balanced_micro_batches(lengths, max_len)
    check_packing(lengths, mbs, max_len)
    assert mbs == expected


def test_micro_batches_balanced():
    # 18 tokens into (at least) 2 micro-batches: 4+3+2 and 4+3+2, not 4+4+3+3 and 2+2
    lengths = [4, 4, 3, 3, 2, 2]
    assert balanced_micro_batches(lengths, 100, min_num_micro_batches=2) == [[0, 2, 4], [1, 3, 5]]
    assert balanced_micro_batches(lengths, 100, min_num_micro_batches=3) == [[0, 4], [1, 5], [2, 3]]


def test_micro_batches_many_random_lengths():
    rnd = random.Random(0)
    for _ in range(50):
        lengths = [rnd.randint(1, 50) for _ in range(rnd.randint(1, 40))]
        mbs = balanced_micro_batches(lengths, 64, min_num_micro_batches=rnd.randint(1, len(lengths)))
        check_packing(lengths, mbs, 64)
        assert len(mbs) >= -(-sum(lengths) // 64)


def test_micro_batches_oversized_sequence():
    with pytest.raises(DataError) as e:
        balanced_micro_batches([3, 12], 10)
    msg = str(e.value)
    assert "12 tokens" in msg and "10" in msg and "ppo_max_token_len_per_gpu" in msg
    assert "max_prompt_length + max_response_length" in msg

# -----------------------------------------------------------------------------
# demo task, CLI

def test_arith_rows_schema_and_answers():
    rows = make_arith_rows(50, "train", seed=0)
    assert len(rows) == 50
    for i, r in enumerate(rows):
        assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert r["data_source"] == "arith" and r["ability"] == "arith"
        (msg,) = r["prompt"]
        assert msg["role"] == "user" and msg["content"].endswith("=")
        a, b = map(int, msg["content"][:-1].split("+"))
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert r["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
        assert r["extra_info"] == {"split": "train", "index": i}
    assert len({r["prompt"][0]["content"] for r in rows}) == 50  # no duplicates below pool size
    assert make_arith_rows(50, "train", seed=0) == rows
    assert make_arith_rows(50, "train", seed=1) != rows


def test_arith_splits_disjoint():
    # max_operand 9: 100 problems in all; ask for more than each pool holds to get all of it
    train = {r["prompt"][0]["content"] for r in make_arith_rows(2000, "train", max_operand=9)}
    val = {r["prompt"][0]["content"] for r in make_arith_rows(2000, "val", max_operand=9)}
    assert not train & val
    assert len(train | val) == 100
    assert 5 <= len(val) <= 30  # about 15%


def test_make_arith_cli_writes_loadable_files(tmp_path):
    prepare_data.main(["make-arith", str(tmp_path / "arith"), "--train", "20", "--val", "5"])
    train, val = str(tmp_path / "arith/train.parquet"), str(tmp_path / "arith/val.parquet")
    assert check_parquet_schema([train]) == 20 and check_parquet_schema([val]) == 5
    item = load([train])[0]
    assert item["prompt_ids"] == ids("U" + item["messages"][0]["content"] + ">")


def test_jsonl2parquet_round_trip(tmp_path):
    rows = [row("a", gt=["1", "one"], split="train", index=0),
            {"data_source": "x", "prompt": [{"role": "user", "content": "b"}],
             "reward_model": {"ground_truth": ["2"]}}]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # blank lines are skipped
    dst = str(tmp_path / "out" / "out.parquet")
    prepare_data.main(["jsonl2parquet", str(src), dst])
    a, b = load([dst])
    assert a["prompt_ids"] == ids("Ua>") and a["ground_truth"] == ["1", "one"]
    assert a["extra_info"] == {"split": "train", "index": 0}
    assert b["prompt_ids"] == ids("Ub>") and b["ground_truth"] == ["2"] and b["extra_info"] == {}


def test_jsonl2parquet_plain_string_prompts(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"data_source": "x", "prompt": "hi", "reward_model": {"ground_truth": "1"}}\n')
    prepare_data.main(["jsonl2parquet", str(src), str(tmp_path / "o.parquet")])
    assert load([str(tmp_path / "o.parquet")])[0]["prompt_ids"] == ids("Uhi>")


def test_mixed_types_across_rows_is_a_clear_error(tmp_path):
    rows = [row("a", gt="1"), row("b", gt=["2"])]
    with pytest.raises(DataError, match="one type per column"):
        write_parquet(rows, str(tmp_path / "m.parquet"))


@pytest.mark.parametrize("line,phrase", [
    ('{"data_source": "x", "prompt": "p"}', "line 2: missing key 'reward_model'"),
    ('{"data_source": "x", "prompt": "p", "reward_model": {}}', "line 2, column 'reward_model.ground_truth'"),
    ('{"data_source": "x", "prompt": [1], "reward_model": {"ground_truth": "1"}}', "line 2, column 'prompt'"),
    ("{not json", "line 2: not valid JSON"),
])
def test_jsonl2parquet_errors_name_line(tmp_path, line, phrase):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(row("a")) + "\n" + line + "\n")
    with pytest.raises(DataError, match=phrase.replace("(", r"\(")):
        prepare_data.main(["jsonl2parquet", str(src), str(tmp_path / "o.parquet")])

# -----------------------------------------------------------------------------
# GSM8K as verl's examples/data_preprocess/gsm8k.py writes it

GSM8K_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'


def test_gsm8k_row_matches_verl():
    q, a = "How many?", "10 * 100 = <<10*100=1000>>1000\n#### 1,000"
    assert prepare_data.gsm8k_row(q, a, "train", 3) == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "How many? Let's think step by step and output the "
                                               'final answer after "####".'}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1000"},
        "extra_info": {"split": "train", "index": 3, "answer": a, "question": q}}


@pytest.mark.parametrize("answer,gt", [("#### -12", "-12"), ("x\n#### 0.5", "0.5"),
                                       ("#### 7 then #### 8", "7"), ("####  9 #### 1,234,567", "1234567")])
def test_gsm8k_ground_truth_extraction(answer, gt):
    # verl: re.search("#### (\-?[0-9\.\,]+)"), first match, commas removed
    assert prepare_data.gsm8k_row("q", answer, "test", 0)["reward_model"]["ground_truth"] == gt


def raw_gsm8k(n, split):
    return [{"question": f"{split} q{i}", "answer": f"so {i}\n#### {i},00{i}"} for i in range(n)]


def check_prepared(out, split, raw):
    """The prepared file holds verl's rows for `raw` in order, and loads with load_prompts."""
    path = str(out / f"{split}.parquet")
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert table.schema.field("extra_info").type.field("index").type == pa.int64()
    got = table.to_pylist()
    assert [r["extra_info"] for r in got] == [{"split": split, "index": i, "answer": x["answer"],
                                               "question": x["question"]} for i, x in enumerate(raw)]
    assert [r["reward_model"] for r in got] == [
        {"style": "rule", "ground_truth": f"{i}00{i}"} for i in range(len(raw))]
    items = load([path])
    assert [it["prompt_ids"] for it in items] == [ids("U" + x["question"] + GSM8K_SUFFIX + ">") for x in raw]
    assert {it["data_source"] for it in items} == {"openai/gsm8k"}


def test_prepare_gsm8k_hf_parquet_layout(tmp_path):
    train, test = raw_gsm8k(3, "train"), raw_gsm8k(2, "test")
    (tmp_path / "raw/main").mkdir(parents=True)
    # two train shards: the index runs on across them, 0 1 2
    pq.write_table(pa.Table.from_pylist(train[:2]), tmp_path / "raw/main/train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(train[2:]), tmp_path / "raw/main/train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(test), tmp_path / "raw/main/test-00000-of-00001.parquet")
    prepare_data.main(["prepare-gsm8k", str(tmp_path / "raw"), str(tmp_path / "out")])
    check_prepared(tmp_path / "out", "train", train)
    check_prepared(tmp_path / "out", "test", test)


def test_prepare_gsm8k_jsonl_layout_and_single_file(tmp_path):
    train, test = raw_gsm8k(2, "train"), raw_gsm8k(1, "test")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/train.jsonl").write_text("\n".join(json.dumps(x) for x in train) + "\n\n")
    (tmp_path / "raw/test.jsonl").write_text(json.dumps(test[0]) + "\n")
    prepare_data.main(["prepare-gsm8k", str(tmp_path / "raw"), str(tmp_path / "out")])
    check_prepared(tmp_path / "out", "train", train)
    check_prepared(tmp_path / "out", "test", test)
    # one file: its name gives the split, and only that split is written
    prepare_data.main(["prepare-gsm8k", str(tmp_path / "raw/test.jsonl"), str(tmp_path / "one")])
    check_prepared(tmp_path / "one", "test", test)
    assert not (tmp_path / "one/train.parquet").exists()


def test_prepare_gsm8k_errors(tmp_path):
    bad = raw_gsm8k(2, "train")
    bad[1]["answer"] = "the answer is 5"
    (tmp_path / "raw/main").mkdir(parents=True)
    (tmp_path / "raw/train.jsonl").write_text("\n".join(json.dumps(x) for x in bad))
    (tmp_path / "raw/test.jsonl").write_text(json.dumps(raw_gsm8k(1, "test")[0]))
    with pytest.raises(DataError, match=r"train.jsonl line 2: answer has no '#### <number>'"):
        prepare_data.main(["prepare-gsm8k", str(tmp_path / "raw"), str(tmp_path / "out")])
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "raw/main/train-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"train-00000-of-00001.parquet row 1: answer has no"):
        prepare_data.main(["prepare-gsm8k", str(tmp_path / "raw"), str(tmp_path / "out")])
    with pytest.raises(DataError, match="no raw GSM8K test split in .*raw/main: looked for main/test-"):
        prepare_data.main(["prepare-gsm8k", str(tmp_path / "raw/main"), str(tmp_path / "out")])  # train only
    (tmp_path / "raw/train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match="train.jsonl line 1: expected string fields 'question' and 'answer'"):
        prepare_data.main(["prepare-gsm8k", str(tmp_path / "raw/train.jsonl"), str(tmp_path / "out")])

# -----------------------------------------------------------------------------
# inspect, on files shaped like DAPO-Math-17k and AIME-2024 (BytedTsinghua-SIA)

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be "
               "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
               "\n\n{}\n\nRemember to put your answer on its own line after \"Answer:\".")


def dapo_row(problem, ds, gt, index):
    return {"data_source": ds, "prompt": [{"content": DAPO_PROMPT.format(problem), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": gt, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


def dapo_and_aime(tmp_path):
    dapo = [dapo_row("a", "math_dapo", "34", "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
            dapo_row("bb", "math_dapo", "5", "b426d104-244d-4831-a2c4-cd756b61700a"),
            dapo_row("ccccc", "math_dapo", "12", "6ff0b17f-7e5c-4ae9-b5e9-63ebecd2b9f7")]
    aime = [dapo_row("ddd", "aime24", "204", "0"), dapo_row("eeeeeeeee", "aime24", "25", "1")]
    return dapo, write(tmp_path, "dapo-math-17k.parquet", dapo), write(tmp_path, "aime-2024.parquet", aime)


def test_inspect_counts_and_example(tmp_path):
    dapo, a, b = dapo_and_aime(tmp_path)
    info = prepare_data.inspect_files([a, b])
    assert {f: d["rows"] for f, d in info["files"].items()} == {a: 3, b: 2}
    assert info["rows"] == 5
    assert info["data_sources"] == {"math_dapo": 3, "aime24": 2}
    assert info["example"] == dapo[0]
    assert pa.types.is_list(info["files"][a]["schema"].field("prompt").type)
    assert "prompt_lengths" not in info and "overlong" not in info


def test_inspect_prompt_lengths(tmp_path):
    _, a, b = dapo_and_aime(tmp_path)
    base = len(DAPO_PROMPT.format("")) + 2  # CharTokenizer adds "U" and ">"
    # problem lengths 1 2 5 | 3 9, sorted 1 2 3 5 9; linear percentile at position p * (5 - 1):
    # p50 -> 3, p90 -> 5 + 0.6 * (9 - 5) = 7.4, p99 -> 5 + 0.96 * 4 = 8.84
    info = prepare_data.inspect_files([a, b], TOK, max_prompt_length=base + 3)
    assert info["prompt_lengths"] == pytest.approx(
        {"min": base + 1, "p50": base + 3, "p90": base + 7.4, "p99": base + 8.84, "max": base + 9})
    assert info["overlong"] == 2  # problems of 5 and 9 characters
    assert prepare_data.inspect_files([a, b], TOK, max_prompt_length=base + 9)["overlong"] == 0


def test_inspect_cli_prints(tmp_path, capsys, monkeypatch):
    _, a, b = dapo_and_aime(tmp_path)
    monkeypatch.setattr(prepare_data.Tokenizer, "from_pretrained", lambda d: TOK)
    base = len(DAPO_PROMPT.format("")) + 2
    prepare_data.main(["inspect", a, b, "--tokenizer", "some/model", "--max_prompt_length", str(base + 3)])
    out = capsys.readouterr().out
    for phrase in [f"{a}: 3 rows", f"{b}: 2 rows", "rows: 5", "{'math_dapo': 3, 'aime24': 2}",
                   "ground_truth': '34'", f"min {base + 1}, p50 {base + 3}, p90 {base + 7.4:g}",
                   f"max_prompt_length={base + 3}: 2 of 5 rows"]:
        assert phrase in out
    with pytest.raises(SystemExit):
        prepare_data.main(["inspect", a, "--max_prompt_length", "5"])  # lengths need a tokenizer

# -----------------------------------------------------------------------------
# tokenizer and chat template, against transformers (a test-only reference)

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}\n"
    "    {%- if message.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + message.role) }}{% endif %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- endif %}\n{{- (messages | tojson) if false }}"
)


def make_tokenizer_dir(path):
    """A trained byte-level BPE saved by transformers, with a Qwen-style template and generation_config.json."""
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 2+2? The answer is 4.", "Solve the problem step by step. Answer: 12"] * 20,
                            trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return fast


def test_tokenizer_matches_transformers(tmp_path):
    ref = make_tokenizer_dir(tmp_path)
    ours = data.Tokenizer.from_pretrained(str(tmp_path))
    text = "What is 12+30? Answer: 42 — ünïcode"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    ids = ref.encode(text, add_special_tokens=False) + [2]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]):
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
                ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(msgs, tokenize=True) == \
            ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.apply_chat_template(msgs, enable_thinking=False) == \
            ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert ours.eos_token_ids == [2, 0]  # eos_token first, then generation_config's extra ids
    with pytest.raises(Exception, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_without_template_is_a_clear_error(tmp_path):
    make_tokenizer_dir(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in tmp_path.glob("chat_template.jinja"):
        f.unlink()
    tok = data.Tokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_kwargs_reach_the_template(tmp_path):
    template = CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    tok = data.Tokenizer.from_pretrained(byte_tokenizer_dir(tmp_path / "m", template=template))
    path = write(tmp_path, "p.parquet", [row("hi")])
    plain = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (item,) = load_prompts([path], tok, max_prompt_length=100)
    assert tok.decode(item["prompt_ids"], skip_special_tokens=False) == plain
    (item,) = load_prompts([path], tok, max_prompt_length=100, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(item["prompt_ids"], skip_special_tokens=False) == plain + "<think>\n\n</think>\n\n"
    info = prepare_data.inspect_files([path], tok, chat_template_kwargs={"enable_thinking": False})
    assert info["prompt_lengths"]["max"] == len(item["prompt_ids"])
    # one id per special, one per byte: <|im_start|> "user\n" "hi" <|im_end|> "\n" <|im_start|> "assistant\n" + 19
    assert len(item["prompt_ids"]) == 1 + 5 + 2 + 1 + 1 + 1 + 10 + 19



def test_template_rejecting_a_row_names_file_row_roles_and_fix(tmp_path):
    # as Gemma's and Mistral's templates do: only user and assistant turns
    template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}{% endfor %}"
                + CHAT_TEMPLATE)
    tok = data.Tokenizer.from_pretrained(byte_tokenizer_dir(tmp_path / "m", template=template))
    system_first = [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]
    with_system = dict(row("b"), prompt=system_first)
    path = write(tmp_path, "p.parquet", [row("a"), with_system, row("c")])
    with pytest.raises(DataError) as e:
        load_prompts([path], tok, max_prompt_length=100)
    msg = str(e.value)
    for phrase in [path, "row 1 (0-based)", "roles ['system', 'user']",
                   "Conversation roles must be user or assistant", "tokenizer_config.json 'chat_template'",
                   "fold the system message", "chat_template_kwargs"]:
        assert phrase in msg, (phrase, msg)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    # rows with only user turns load with the same template
    ok = write(tmp_path, "ok.parquet", [row("a"), row("c")])
    items = load_prompts([ok], tok, max_prompt_length=100)
    assert [tok.decode(i["prompt_ids"], skip_special_tokens=False) for i in items] == \
        [f"<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n" for c in "ac"]

@pytest.mark.parametrize("eos_token,generation_config,config,expected", [
    ("<|im_end|>", None, None, [2]),                                   # the tokenizer's eos_token alone
    ("<|im_end|>", None, {"eos_token_id": 0}, [2, 0]),                 # no generation_config.json: config.json's
    (None, {"eos_token_id": 0}, {"eos_token_id": 2}, [0]),             # generation_config.json wins over config.json
    (None, None, {"eos_token_id": 0}, [0]),                            # no eos_token: config.json's (int)
    ("<|eot|>", {"bos_token_id": 1}, {"eos_token_id": [2, 0]}, [2, 0]),  # eos_token not in vocab, gc without eos: list
])
def test_eos_token_ids_fall_back_like_transformers(tmp_path, eos_token, generation_config, config, expected):
    path = byte_tokenizer_dir(tmp_path, eos_token=eos_token, generation_config=generation_config, config=config)
    assert data.Tokenizer.from_pretrained(path).eos_token_ids == expected


@pytest.mark.parametrize("eos_token,generation_config,config", [
    (None, None, None), ("<|eot|>", {}, {"vocab_size": 10}), (None, {"eos_token_id": None}, {"eos_token_id": None})])
def test_no_stop_token_is_a_clear_error(tmp_path, eos_token, generation_config, config):
    path = byte_tokenizer_dir(tmp_path, eos_token=eos_token, generation_config=generation_config, config=config)
    with pytest.raises(DataError) as e:
        data.Tokenizer.from_pretrained(path)
    msg = str(e.value)
    assert "no stop token" in msg and "max_response_length" in msg
    assert "eos_token in tokenizer_config.json" in msg and "eos_token_id in generation_config.json" in msg


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0"}', "TRUNCATE"])
def test_corrupt_tokenizer_json_names_the_file(tmp_path, content):
    path = byte_tokenizer_dir(tmp_path)
    tj = tmp_path / "tokenizer.json"
    tj.write_text(tj.read_text()[:200] if content == "TRUNCATE" else content)
    with pytest.raises(DataError) as e:
        data.Tokenizer.from_pretrained(path)
    assert str(tj) in str(e.value) and "copy it again" in str(e.value)


def test_corrupt_tokenizer_config_names_the_file(tmp_path):
    path = byte_tokenizer_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(DataError, match="tokenizer_config.json is not valid JSON"):
        data.Tokenizer.from_pretrained(path)


def test_check_chat_template_accepts_a_working_template(tmp_path):
    data.Tokenizer.from_pretrained(byte_tokenizer_dir(tmp_path)).check_chat_template()


def test_check_chat_template_syntax_error_names_file_and_line(tmp_path):
    bad = "{% for m in messages %}\n{{ m['content'] }}\n{% if add_generation_prompt %}x{% endfor %}"
    tok = data.Tokenizer.from_pretrained(byte_tokenizer_dir(tmp_path, template=bad))
    with pytest.raises(DataError) as e:
        tok.check_chat_template()
    msg = str(e.value)
    assert "tokenizer_config.json 'chat_template'" in msg and "syntax error at template line 3" in msg
    assert "endfor" in msg and "fix the template" in msg


def test_check_chat_template_render_error_names_line_and_kwargs(tmp_path):
    # a template that needs a variable (as a model's template may need enable_thinking), in chat_template.jinja
    needs = "{{ bos_token }}\n{% if mode is not defined %}{{ raise_exception('pass mode') }}{% endif %}\n" + CHAT_TEMPLATE
    path = byte_tokenizer_dir(tmp_path, template=None)
    (tmp_path / "chat_template.jinja").write_text(needs)
    tok = data.Tokenizer.from_pretrained(path)
    with pytest.raises(DataError) as e:
        tok.check_chat_template()
    msg = str(e.value)
    for phrase in ["chat_template.jinja fails", "TemplateError at template line 2: pass mode", "chat_template_kwargs"]:
        assert phrase in msg
    tok.check_chat_template({"mode": 1})
    with pytest.raises(DataError, match="TypeError at template line 1"):  # bos_token unset: "" + None
        data.Tokenizer.from_pretrained(byte_tokenizer_dir(tmp_path / "b", template="{{ '' + bos_token }}")) \
            .check_chat_template({"bos_token": None})


def test_check_chat_template_without_template(tmp_path):
    tok = data.Tokenizer.from_pretrained(byte_tokenizer_dir(tmp_path, template=None))
    with pytest.raises(DataError, match="no chat template"):
        tok.check_chat_template()
