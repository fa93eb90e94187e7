"""
Preparing and inspecting data in verl's parquet schema (the training path reads it with data.py):

    python tools/prepare_data.py make-arith data/arith --train 4000 --val 200   # the CPU demo task
    python tools/prepare_data.py make-fewshot-arith data/fewshot_arith          # the SmolLM2 recipe's task
    python tools/prepare_data.py make-fewshot-sums data/fewshot_sums   # the SmolLM2 task with worked steps
    python tools/prepare_data.py prepare-gsm8k RAW_DIR data/gsm8k   # raw GSM8K (HF or openai jsonl) -> verl's rows
    python tools/prepare_data.py jsonl2parquet IN.jsonl OUT.parquet        # one JSON row per line
    python tools/prepare_data.py inspect data/gsm8k/train.parquet --tokenizer MODEL_DIR --max_prompt_length 512

No torch: these need pyarrow, and tokenizers + jinja2 for inspect's --tokenizer.
"""
import argparse
import collections
import glob
import json
import os
import zlib

import numpy as np
import pyarrow.parquet as pq

from data import (SCHEMA, DataError, Tokenizer, check_parquet_schema, parse_row, prompt_messages, required_columns,
                  write_parquet)
from reward import GSM8K_ANSWER

# -----------------------------------------------------------------------------
# the CPU demo task, JSON lines

def arith_split(a, b):
    """Which split the problem a+b belongs to: a stable hash puts ~15% of all problems in val."""
    return "val" if zlib.crc32(f"{a}+{b}".encode()) % 100 < 15 else "train"


def make_arith_rows(num_rows, split, seed=0, max_operand=99):
    """Integer addition problems in verl's schema; train and val never share a problem."""
    pool = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)
            if arith_split(a, b) == split]
    if not pool:
        raise DataError(f"no {split!r} problems with max_operand={max_operand}; use split "
                        f"'train' or 'val' and a larger max_operand")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(pool), size=num_rows, replace=num_rows > len(pool))
    rows = []
    for i, p in enumerate(picks.tolist()):
        a, b = pool[p]
        rows.append({"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "ability": "arith", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": split, "index": i}})
    return rows


FEWSHOT_EXAMPLES = ((3, 5), (12, 7), (24, 19))  # one-digit, mixed and two-digit operands, answered "Answer: N"


def random_operand(rng, one_digit_prob):
    if rng.random() < one_digit_prob:
        return int(rng.integers(0, 10))
    return int(rng.integers(10, 100))


def make_fewshot_arith_rows(num_rows, split, seed=0, one_digit_prob=0.3):
    """Addition of one- and two-digit numbers as a chat with three solved examples before the question, answered
    "Answer: N" (data_source math_dapo, DAPO's verifier). Each operand has one digit with probability
    one_digit_prob; train and val never share a problem (arith_split)."""
    rng = np.random.default_rng(seed)
    shots = []
    for a, b in FEWSHOT_EXAMPLES:
        shots += [{"role": "user", "content": f"What is {a} + {b}?"},
                  {"role": "assistant", "content": f"Answer: {a + b}"}]
    rows = []
    while len(rows) < num_rows:
        a, b = random_operand(rng, one_digit_prob), random_operand(rng, one_digit_prob)
        if arith_split(a, b) != split or (a, b) in FEWSHOT_EXAMPLES:
            continue
        rows.append({"data_source": "math_dapo",
                     "prompt": shots + [{"role": "user", "content": f"What is {a} + {b}?"}],
                     "ability": "arith", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": split, "index": len(rows)}})
    return rows


# sums of several numbers, each step written out before the answer: a task whose responses run to tens of tokens
# (SmolLM2-135M-Instruct's: 42 on average), so token- vs sequence-level losses and overlong shaping have lengths
# to act on. The six solved examples before every question: three to five terms, mostly one-digit.
FEWSHOT_SUMS = ((7, 5, 8), (3, 9, 4, 6), (12, 7, 30), (6, 2, 9, 5, 8), (4, 18, 7, 3), (9, 6, 25, 1, 7))


def sum_steps(terms) -> str:
    """The worked solution: one line per addition of the running total and the next term, then the answer line
    DAPO's verifier reads. (12, 7, 30) -> "12 + 7 = 19\\n19 + 30 = 49\\nAnswer: 49"."""
    if len(terms) < 2:
        raise DataError(f"a sum needs at least two terms, got {list(terms)}")
    lines, total = [], terms[0]
    for t in terms[1:]:
        lines.append(f"{total} + {t} = {total + t}")
        total += t
    return "\n".join(lines + [f"Answer: {total}"])


def sums_question(terms) -> str:
    return "What is " + " + ".join(map(str, terms)) + "?"


def sums_split(terms) -> str:
    """Which split the sum of these terms, in this order, belongs to: a stable hash puts ~15% of them in val."""
    return "val" if zlib.crc32("+".join(map(str, terms)).encode()) % 100 < 15 else "train"


def sums_fewshot_messages() -> list[dict]:
    """The solved examples that open every prompt of the sums task."""
    shots = []
    for terms in FEWSHOT_SUMS:
        shots += [{"role": "user", "content": sums_question(terms)},
                  {"role": "assistant", "content": sum_steps(terms)}]
    return shots


def make_fewshot_sums_rows(num_rows, split, seed=0, min_terms=3, max_terms=4, one_digit_prob=1.0):
    """Sums of min_terms..max_terms one- and two-digit numbers as a chat with worked examples (FEWSHOT_SUMS)
    before the question, answered with the running total step by step and a last line "Answer: N"
    (data_source math_dapo, DAPO's verifier). Each term has one digit with probability one_digit_prob; the
    number of terms is uniform. Train and val never share a problem (sums_split); the examples are in neither.
    Val rows are distinct problems (train rows may repeat one)."""
    if not 2 <= min_terms <= max_terms:
        raise DataError(f"need 2 <= min_terms <= max_terms, got min_terms={min_terms}, max_terms={max_terms}")
    if not 0 <= one_digit_prob <= 1:
        raise DataError(f"one_digit_prob={one_digit_prob} is not a probability")
    if split not in ("train", "val"):
        raise DataError(f"split={split!r}; use 'train' or 'val'")
    rng = np.random.default_rng(seed)
    shots = sums_fewshot_messages()
    rows, seen, misses = [], set(), 0
    while len(rows) < num_rows:
        k = int(rng.integers(min_terms, max_terms + 1))
        terms = tuple(random_operand(rng, one_digit_prob) for _ in range(k))
        if sums_split(terms) != split or terms in FEWSHOT_SUMS or (split == "val" and terms in seen):
            misses += 1
            if misses > 100 * num_rows + 10000:
                raise DataError(f"found only {len(rows)} distinct {split} problems of {num_rows}: ask for "
                                f"fewer rows, or more terms or two-digit ones (max_terms, one_digit_prob)")
            continue
        seen.add(terms)
        rows.append({"data_source": "math_dapo",
                     "prompt": shots + [{"role": "user", "content": sums_question(terms)}],
                     "ability": "arith", "reward_model": {"style": "rule", "ground_truth": str(sum(terms))},
                     "extra_info": {"split": split, "index": len(rows), "terms": list(terms)}})
    return rows


def read_jsonl(path):
    """(where, object) for each non-blank line of a JSON-lines file; bad JSON raises DataError naming the line."""
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                out.append((f"{path} line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n}: not valid JSON ({e})") from None
    return out


def jsonl_to_rows(path, prompt_key="prompt"):
    """Read a JSON-lines file of rows in verl's schema, validating each with its line number."""
    rows = []
    for where, row in read_jsonl(path):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in required_columns(prompt_key):
            if key not in row:
                raise DataError(f"{where}: missing key '{key}'; {SCHEMA}")
        parse_row(row, where, prompt_key)
        rows.append(row)
    if not rows:
        raise DataError(f"{path} has no rows")
    return rows

# -----------------------------------------------------------------------------
# GSM8K in verl's schema, and a look inside parquet files

# verl's examples/data_preprocess/gsm8k.py: the instruction appended to each question, and the
# final answer taken from the first "#### <number>" with commas removed ("#### 1,000" -> "1000")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_row(question, answer, split, index):
    """One raw GSM8K example as verl's gsm8k preprocessor writes it."""
    m = GSM8K_ANSWER.search(answer)
    if m is None:
        raise DataError(f"answer has no '#### <number>' final answer: {answer!r:.200}")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": m.group(1).replace(",", "")},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question}}


def gsm8k_raw_files(raw, split):
    """A split's raw files: HF's main/{split}-*.parquet (shards in order), {split}.parquet or .jsonl."""
    for pattern in ("main/{}-*.parquet", "{}-*.parquet", "{}.parquet", "{}.jsonl"):
        found = sorted(glob.glob(os.path.join(raw, pattern.format(split))))
        if found:
            return found
    raise DataError(f"no raw GSM8K {split} split in {raw}: looked for main/{split}-*.parquet (Hugging "
                    f"Face openai/gsm8k), {split}.parquet, {split}.jsonl (openai/grade-school-math)")


def _raw_gsm8k(f):
    """(where, example) for each line of a JSON-lines file or row of a parquet file."""
    if f.endswith(".jsonl"):
        return read_jsonl(f)
    return [(f"{f} row {r}", x) for r, x in enumerate(pq.read_table(f).to_pylist())]


def read_gsm8k(files, split):
    """Raw GSM8K files ({question, answer} rows) -> rows in verl's schema, indexed across the files."""
    rows = []
    for where, x in (item for f in files for item in _raw_gsm8k(f)):
        if not (isinstance(x, dict) and all(isinstance(x.get(k), str) for k in ("question", "answer"))):
            raise DataError(f"{where}: expected string fields 'question' and 'answer' (raw GSM8K), "
                            f"got {x!r:.200}")
        try:  # index counts rows across a split's shards, as verl's map(with_indices=True)
            rows.append(gsm8k_row(x["question"], x["answer"], split, len(rows)))
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
    return rows


def inspect_files(files, tokenizer=None, max_prompt_length=None, prompt_key="prompt", chat_template_kwargs=None):
    """Schema, rows per file, data_source counts and the first row; with a tokenizer, templated
    prompt length percentiles (numpy's linear interpolation) and the count over max_prompt_length."""
    check_parquet_schema(files, prompt_key)
    out = {"files": {}, "rows": 0, "data_sources": collections.Counter()}
    lengths = []
    for f in files:
        pf = pq.ParquetFile(f)
        out["files"][f] = {"schema": pf.schema_arrow, "rows": pf.metadata.num_rows}
        out["rows"] += pf.metadata.num_rows
        if "example" not in out:
            out["example"] = next(pf.iter_batches(batch_size=1)).to_pylist()[0]
        cols = ["data_source"] + ([prompt_key] if tokenizer is not None else [])
        for r, row in enumerate(pf.read(columns=cols).to_pylist()):
            out["data_sources"][row["data_source"]] += 1
            if tokenizer is not None:
                msgs = prompt_messages(row[prompt_key], f"{f} row {r}", prompt_key)
                lengths.append(len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                 **(chat_template_kwargs or {}))))
    out["data_sources"] = dict(out["data_sources"].most_common())
    if lengths:
        q = np.percentile(lengths, [0, 50, 90, 99, 100])
        out["prompt_lengths"] = dict(zip(("min", "p50", "p90", "p99", "max"), q.tolist()))
        if max_prompt_length is not None:
            out["overlong"] = sum(n > max_prompt_length for n in lengths)
    return out

# -----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description="prepare and inspect data for nanodapo (verl's parquet schema)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("jsonl2parquet", help="convert JSON lines in verl's schema to parquet")
    p.add_argument("src")
    p.add_argument("dst")
    p = sub.add_parser("make-arith", help="write the CPU demo task: OUT_DIR/{train,val}.parquet")
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=4000, help="train rows")
    p.add_argument("--val", type=int, default=200, help="val rows")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("make-fewshot-arith", help="write the SmolLM2 recipe's task: OUT_DIR/{train,val}.parquet")
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=20000, help="train rows")
    p.add_argument("--val", type=int, default=256, help="val rows")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("make-fewshot-sums", help="write the worked-sums task: OUT_DIR/{train,val}.parquet")
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=20000, help="train rows")
    p.add_argument("--val", type=int, default=256, help="val rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min_terms", type=int, default=3)
    p.add_argument("--max_terms", type=int, default=4)
    p.add_argument("--one_digit_prob", type=float, default=1.0, help="chance that a term has one digit")
    p = sub.add_parser("prepare-gsm8k", help="raw GSM8K -> OUT_DIR/{train,test}.parquet, as verl")
    p.add_argument("raw", help="a folder with the train and test splits, or one raw split file")
    p.add_argument("out_dir")
    p = sub.add_parser("inspect", help="schema, row and data_source counts, prompt lengths")
    p.add_argument("files", nargs="+")
    p.add_argument("--tokenizer", help="model folder; adds templated prompt length percentiles")
    p.add_argument("--max_prompt_length", type=int, help="count prompts longer than this")
    p.add_argument("--prompt_key", default="prompt")
    p.add_argument("--chat_template_kwargs", type=json.loads, default=None,
                   help='JSON, as the trainer\'s knob, e.g. \'{"enable_thinking": false}\' for Qwen3')
    args = parser.parse_args(argv)

    if args.cmd == "jsonl2parquet":
        rows = jsonl_to_rows(args.src)
        write_parquet(rows, args.dst)
        print(f"wrote {len(rows)} rows to {args.dst}")
    elif args.cmd == "make-arith":
        for split, n in (("train", args.train), ("val", args.val)):
            path = os.path.join(args.out_dir, f"{split}.parquet")
            write_parquet(make_arith_rows(n, split, seed=args.seed), path)
            print(f"wrote {n} {split} rows to {path}")
    elif args.cmd == "make-fewshot-arith":
        for split, n in (("train", args.train), ("val", args.val)):
            path = os.path.join(args.out_dir, f"{split}.parquet")
            write_parquet(make_fewshot_arith_rows(n, split, seed=args.seed), path)
            print(f"wrote {n} {split} rows to {path}")
    elif args.cmd == "make-fewshot-sums":
        for split, n in (("train", args.train), ("val", args.val)):
            path = os.path.join(args.out_dir, f"{split}.parquet")
            write_parquet(make_fewshot_sums_rows(n, split, seed=args.seed, min_terms=args.min_terms,
                                                 max_terms=args.max_terms, one_digit_prob=args.one_digit_prob),
                          path)
            print(f"wrote {n} {split} rows to {path}")
    elif args.cmd == "prepare-gsm8k":
        if os.path.isfile(args.raw):  # one split file: its name says which
            name = os.path.basename(args.raw)
            splits = [(s, [args.raw]) for s in ("train", "test") if name.startswith(s)]
            if not splits:
                raise DataError(f"cannot tell the split of {args.raw}: name it train* or test*")
        else:
            splits = [(s, gsm8k_raw_files(args.raw, s)) for s in ("train", "test")]
        for split, files in splits:
            rows = read_gsm8k(files, split)
            path = os.path.join(args.out_dir, f"{split}.parquet")
            write_parquet(rows, path)
            print(f"wrote {len(rows)} {split} rows from {', '.join(files)} to {path}")
    elif args.cmd == "inspect":
        if args.max_prompt_length is not None and not args.tokenizer:
            parser.error("--max_prompt_length needs --tokenizer MODEL_DIR to count tokens")
        tok = Tokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
        info = inspect_files(args.files, tok, args.max_prompt_length, args.prompt_key, args.chat_template_kwargs)
        for f, d in info["files"].items():
            print(f"{f}: {d['rows']} rows\n{d['schema']}\n")
        print(f"rows: {info['rows']}\ndata_source: {info['data_sources']}\nexample row:")
        for k, v in info["example"].items():
            print(f"  {k}: {v!r:.300}")
        if "prompt_lengths" in info:
            lengths = ", ".join(f"{k} {v:g}" for k, v in info["prompt_lengths"].items())
            print(f"templated prompt tokens: {lengths}")
        if "overlong" in info:
            print(f"longer than max_prompt_length={args.max_prompt_length}: "
                  f"{info['overlong']} of {info['rows']} rows")


if __name__ == "__main__":
    try:
        main()
    except (DataError, OSError) as e:  # a message, not a traceback, for data mistakes
        raise SystemExit(f"error: {e}")
