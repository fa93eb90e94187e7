"""
Prompts in, index batches out: parquet datasets in verl's schema, chat templating, truncation,
overlong-prompt filtering, a resumable sampler, and token-budget micro-batching.

A row (the schema verl's data preprocessors write, so their parquet files load unchanged):
    {data_source: str, prompt: [{role, content}, ...] or str, ability: str,
     reward_model: {style: "rule", ground_truth: str | [str]}, extra_info: {split, index, ...}}

Command line:
    python data.py jsonl2parquet IN.jsonl OUT.parquet        # one JSON row per line
    python data.py make-arith data/arith --train 4000 --val 200   # the CPU demo task
    python data.py prepare-gsm8k RAW_DIR data/gsm8k   # raw GSM8K (HF or openai jsonl) -> verl's rows
    python data.py inspect data/gsm8k/train.parquet --tokenizer MODEL_DIR --max_prompt_length 512
"""
import argparse
import collections
import glob
import json
import math
import os
import re
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")  # "prompt" stands for prompt_key
TRUNCATION_MODES = ("error", "left", "right", "middle")
SCHEMA = "verl's schema needs data_source, prompt, reward_model.ground_truth"
SCHEMA_HINT = SCHEMA + "; convert with `python data.py jsonl2parquet`"


class DataError(ValueError):
    """A problem with the data or a data knob; the message names the place and the fix."""


def _required(prompt_key):
    return [prompt_key if c == "prompt" else c for c in REQUIRED_COLUMNS]

# -----------------------------------------------------------------------------
# reading parquet in verl's schema

def check_parquet_schema(files, prompt_key="prompt"):
    """Cheap check (metadata only) that every file is parquet in verl's schema; returns total rows."""
    if not files:
        raise DataError("no data files given; pass at least one parquet file in verl's schema")
    total = 0
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"data file not found: {f}; check the path (relative paths are "
                            f"relative to {os.getcwd()})")
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{f} is not a readable parquet file ({e}); {SCHEMA_HINT}") from None
        schema = pf.schema_arrow
        for col in _required(prompt_key):
            if col not in schema.names:
                raise DataError(f"missing column '{col}' in {f} (has {schema.names}); {SCHEMA_HINT}")
        rm = schema.field("reward_model").type
        if not pa.types.is_struct(rm) or rm.get_field_index("ground_truth") < 0:
            raise DataError(f"column 'reward_model' in {f} is {rm}, not a struct with a "
                            f"'ground_truth' field; {SCHEMA_HINT}")
        if pf.metadata.num_rows == 0:
            raise DataError(f"{f} has 0 rows; point the data knob at a non-empty file")
        total += pf.metadata.num_rows
    return total


def _messages(value, where, prompt_key):
    # verl's prompts are chat messages; a plain string is one user turn
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    ok = isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise DataError(f"{where}, column '{prompt_key}': expected a string or a non-empty list "
                        f"of {{role, content}} string dicts, got {value!r:.200}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _ground_truth(reward_model, where):
    gt = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if isinstance(gt, (int, float)) and not isinstance(gt, bool):
        gt = str(gt)  # some converters store numeric answers; verifiers compare strings
    if isinstance(gt, str) or (isinstance(gt, list) and gt and all(isinstance(g, str) for g in gt)):
        return gt
    raise DataError(f"{where}, column 'reward_model.ground_truth': expected a string or a list "
                    f"of strings, got {gt!r:.200}")


def parse_row(row, where, prompt_key="prompt"):
    """Validate one row of verl's schema; returns it without prompt ids. `where` names the row in errors."""
    ds = row.get("data_source")
    if not isinstance(ds, str):
        raise DataError(f"{where}, column 'data_source': expected a string, got {ds!r:.200}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}, column 'extra_info': expected a dict, got {extra!r:.200}")
    return {"data_source": ds, "ground_truth": _ground_truth(row.get("reward_model"), where),
            "extra_info": extra or {}, "messages": _messages(row.get(prompt_key), where, prompt_key)}


def truncate(ids, max_len, mode):
    """Cut a prompt to max_len tokens: left keeps the end, right the start, middle both ends."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    raise DataError(f"unknown truncation mode {mode!r}; use one of {TRUNCATION_MODES}")


def load_prompts(files, tokenizer, *, prompt_key="prompt", max_prompt_length, truncation="error",
                 filter_overlong_prompts=False, max_samples=-1):
    """Read parquet files in verl's schema (concatenated in order) and tokenize with the chat template.

    Each item: {prompt_ids, data_source, ground_truth, extra_info, messages}. Overlong prompts are
    dropped first (filter_overlong_prompts), then the first max_samples kept, then truncated."""
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"unknown truncation mode {truncation!r}; use one of {TRUNCATION_MODES}")
    if max_prompt_length < 1:
        raise DataError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    files = [files] if isinstance(files, str) else list(files)
    check_parquet_schema(files, prompt_key)
    items, places, seen = [], [], 0
    limit = max_samples if max_samples > 0 else math.inf
    for f in files:
        if len(items) >= limit:
            break  # enough rows: skip reading and tokenizing the rest
        schema = pq.read_schema(f)
        cols = [c for c in ("data_source", prompt_key, "reward_model", "extra_info") if c in schema.names]
        for r, row in enumerate(pq.read_table(f, columns=cols).to_pylist()):
            if len(items) >= limit:
                break
            seen += 1
            item = parse_row(row, f"{f} row {r}", prompt_key)
            item["prompt_ids"] = list(tokenizer.apply_chat_template(
                item["messages"], add_generation_prompt=True, tokenize=True))
            if filter_overlong_prompts and len(item["prompt_ids"]) > max_prompt_length:
                continue
            items.append(item)
            places.append((f, r))
    if filter_overlong_prompts:
        print(f"filter_overlong_prompts: dropped {seen - len(items)} of {seen} prompts "
              f"longer than max_prompt_length={max_prompt_length} tokens")
        if not items:
            raise DataError(f"filter_overlong_prompts dropped all {seen} prompts in {files}; "
                            f"raise max_prompt_length or use truncation=left/right/middle instead")
    for item, (f, r) in zip(items, places):
        n = len(item["prompt_ids"])
        if n > max_prompt_length and truncation == "error":
            raise DataError(
                f"{f} row {r}: prompt is {n} tokens after the chat template, longer than "
                f"max_prompt_length={max_prompt_length}; set filter_overlong_prompts=True to drop such "
                f"rows, or truncation=left/right/middle to cut them (or raise max_prompt_length)")
        item["prompt_ids"] = truncate(item["prompt_ids"], max_prompt_length, truncation)
    return items

# -----------------------------------------------------------------------------
# resumable sampler

class PromptSampler:
    """Prompt indices in a fresh deterministic permutation each epoch; resumes exactly from a state dict."""

    def __init__(self, num_prompts, seed, shuffle=True):
        if num_prompts < 1:
            raise DataError(f"PromptSampler needs at least one prompt, got num_prompts={num_prompts}")
        self.num_prompts, self.seed, self.shuffle = num_prompts, seed, shuffle
        self._start(epoch=0, position=0)

    def _start(self, epoch, position):
        self.epoch, self.position = epoch, position
        if self.shuffle:  # seeded by (seed, epoch) so any epoch's order can be rebuilt on resume
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
        else:
            self._perm = np.arange(self.num_prompts)

    @property
    def consumed(self):
        return self.epoch * self.num_prompts + self.position

    def next_indices(self, k):
        out = []
        while len(out) < k:
            take = min(k - len(out), self.num_prompts - self.position)
            out += self._perm[self.position:self.position + take].tolist()
            self.position += take
            if self.position == self.num_prompts:
                # roll over now, not on the next call: `epoch` always names where the next index
                # comes from, and a state saved at an epoch's end resumes at the next one (verl #5725)
                self._start(self.epoch + 1, 0)
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_prompts": self.num_prompts}

    def load_state_dict(self, d):
        if d["num_prompts"] != self.num_prompts:
            raise DataError(f"sampler state was saved with {d['num_prompts']} prompts but the data now "
                            f"has {self.num_prompts}; resume with the same data files and filters")
        self.seed = d["seed"]
        self._start(d["epoch"], d["position"])

# -----------------------------------------------------------------------------
# token-budget micro-batching (use_dynamic_bsz)

def balanced_micro_batches(lengths, max_token_len, min_num_micro_batches=1):
    """Split sequence indices into as few micro-batches as fit max_token_len tokens each, balanced.

    Longest first, each into the currently lightest micro-batch (if that one cannot take it, none can,
    so use one more micro-batch and start over). Indices ascending inside a micro-batch; micro-batches
    heaviest first, so an out-of-memory shows up on the first one."""
    for i, n in enumerate(lengths):
        if n > max_token_len:
            raise DataError(
                f"sequence {i} has {n} tokens but the micro-batch token budget is {max_token_len}; set "
                f"ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu >= "
                f"max_prompt_length + max_response_length")
    if min_num_micro_batches > len(lengths):
        raise DataError(f"cannot make {min_num_micro_batches} non-empty micro-batches "
                        f"from {len(lengths)} sequences")
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    k = max(math.ceil(sum(lengths) / max_token_len), min_num_micro_batches, 1)
    while True:
        bins, loads = [[] for _ in range(k)], [0] * k
        for i in order:  # lightest bin, ties to the emptier then the first one
            b = min(range(k), key=lambda j: (loads[j], len(bins[j]), j))
            if loads[b] + lengths[i] > max_token_len:
                break
            bins[b].append(i)
            loads[b] += lengths[i]
        else:
            bins = [sorted(b) for b in bins]
            return sorted(bins, key=lambda b: (-sum(lengths[i] for i in b), b[0]))
        k += 1  # terminates: with one sequence per micro-batch everything fits

# -----------------------------------------------------------------------------
# the CPU demo task and writing parquet

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


def write_parquet(rows, path):
    """Write rows with pyarrow; dicts become structs and message lists list<struct>, as verl's files."""
    try:
        table = pa.Table.from_pylist(rows)
    except pa.ArrowException as e:
        raise DataError(f"cannot write {path}: a column holds values of different types across rows "
                        f"({e}); parquet needs one type per column, e.g. every prompt a list of "
                        f"messages and every ground_truth a string (or every one a list)") from None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(table, path)


def jsonl_to_rows(path, prompt_key="prompt"):
    """Read a JSON-lines file of rows in verl's schema, validating each with its line number."""
    rows = []
    with open(path) as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
            for key in _required(prompt_key):
                if key not in row:
                    raise DataError(f"{path} line {n}: missing key '{key}'; {SCHEMA}")
            parse_row(row, f"{path} line {n}", prompt_key)
            rows.append(row)
    if not rows:
        raise DataError(f"{path} has no rows")
    return rows

# -----------------------------------------------------------------------------
# GSM8K in verl's schema, and a look inside parquet files

# verl's examples/data_preprocess/gsm8k.py: the instruction appended to each question, and the
# final answer taken from the first "#### <number>" with commas removed ("#### 1,000" -> "1000")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


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
    if not f.endswith(".jsonl"):
        return [(f"{f} row {r}", x) for r, x in enumerate(pq.read_table(f).to_pylist())]
    out = []
    with open(f) as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                out.append((f"{f} line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{f} line {n}: not valid JSON ({e})") from None
    return out


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


def inspect_files(files, tokenizer=None, max_prompt_length=None, prompt_key="prompt"):
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
                msgs = _messages(row[prompt_key], f"{f} row {r}", prompt_key)
                lengths.append(len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                 tokenize=True)))
    out["data_sources"] = dict(out["data_sources"].most_common())
    if lengths:
        q = np.percentile(lengths, [0, 50, 90, 99, 100])
        out["prompt_lengths"] = dict(zip(("min", "p50", "p90", "p99", "max"), q.tolist()))
        if max_prompt_length is not None:
            out["overlong"] = sum(n > max_prompt_length for n in lengths)
    return out

# -----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description="data tools for nanodapo (verl's parquet schema)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("jsonl2parquet", help="convert JSON lines in verl's schema to parquet")
    p.add_argument("src")
    p.add_argument("dst")
    p = sub.add_parser("make-arith", help="write the CPU demo task: OUT_DIR/{train,val}.parquet")
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=4000, help="train rows")
    p.add_argument("--val", type=int, default=200, help="val rows")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("prepare-gsm8k", help="raw GSM8K -> OUT_DIR/{train,test}.parquet, as verl")
    p.add_argument("raw", help="a folder with the train and test splits, or one raw split file")
    p.add_argument("out_dir")
    p = sub.add_parser("inspect", help="schema, row and data_source counts, prompt lengths")
    p.add_argument("files", nargs="+")
    p.add_argument("--tokenizer", help="model folder; adds templated prompt length percentiles")
    p.add_argument("--max_prompt_length", type=int, help="count prompts longer than this")
    p.add_argument("--prompt_key", default="prompt")
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
        tok = None
        if args.tokenizer:
            from model import Tokenizer  # torch is imported only when lengths are asked for
            tok = Tokenizer.from_pretrained(args.tokenizer)
        info = inspect_files(args.files, tok, args.max_prompt_length, args.prompt_key)
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
