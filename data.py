"""
Prompts in, index batches out: the tokenizer with its chat template, parquet datasets in verl's schema,
chat templating, truncation, overlong-prompt filtering, a resumable sampler, and token-budget micro-batching.
No torch here: preparing and inspecting data (tools/prepare_data.py) needs only pyarrow, tokenizers and
jinja2.

A row (the schema verl's data preprocessors write, so their parquet files load unchanged):
    {data_source: str, prompt: [{role, content}, ...] or str, ability: str,
     reward_model: {style: "rule", ground_truth: str | [str]}, extra_info: {split, index, ...}}
"""
import json
import math
import os
import traceback
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TRUNCATION_MODES = ("error", "left", "right", "middle")
SCHEMA = "verl's schema needs data_source, prompt, reward_model.ground_truth"
SCHEMA_HINT = SCHEMA + "; convert with `python tools/prepare_data.py jsonl2parquet`"


class DataError(ValueError):
    """A problem with the data, the tokenizer files or a data knob; the message names the place and the
    fix."""


def required_columns(prompt_key):
    return ["data_source", prompt_key, "reward_model"]

# -----------------------------------------------------------------------------
# reading parquet in verl's schema

def check_parquet_schema(files, prompt_key="prompt"):
    """Cheap check (metadata only) that every file is parquet in verl's schema; returns total rows."""
    if not files:
        raise DataError("no data files given; pass at least one parquet file in verl's schema")
    total = 0
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"data file not found: {f}; check the path (relative paths are relative to "
                            f"{os.getcwd()})")
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{f} is not a readable parquet file ({e}); {SCHEMA_HINT}") from None
        schema = pf.schema_arrow
        for col in required_columns(prompt_key):
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


def prompt_messages(value, where, prompt_key):
    """A row's prompt as chat messages: verl's list of {role, content}, or a plain string as one user turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise DataError(f"{where}, column '{prompt_key}': expected a string or a non-empty list "
                        f"of {{role, content}} string dicts, got {value!r:.200}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _ground_truth(reward_model, where, float32=False):
    """A row's reward_model.ground_truth as the verifiers take it: a string or a non-empty list of strings; a
    number becomes its text."""
    gt = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    # numeric answers become text, since the verifiers compare strings (NaN: a missing answer, an error below)
    if isinstance(gt, float) and math.isfinite(gt):
        if float32:  # the shortest text that reads back as this float32 ("0.1", not "0.10000000149011612")
            gt = float(str(np.float32(gt)))
        gt = str(int(gt)) if gt.is_integer() else repr(gt)  # 85.0 -> "85", 0.5 -> "0.5"
    elif isinstance(gt, int) and not isinstance(gt, bool):
        gt = str(gt)
    if isinstance(gt, str) or (isinstance(gt, list) and gt and all(isinstance(g, str) for g in gt)):
        return gt
    raise DataError(f"{where}, column 'reward_model.ground_truth': expected a string, a list of strings or "
                    f"a number, got {type(gt).__name__} {gt!r:.200}; write the answers as strings")


def parse_row(row, where, prompt_key="prompt", float32_ground_truth=False):
    """Validate one row of verl's schema; returns it without prompt ids. `where` names the row in errors;
    float32_ground_truth: the file stores ground_truth as float32 (then 0.1 is "0.1", not its double)."""
    ds = row.get("data_source")
    if not isinstance(ds, str):
        raise DataError(f"{where}, column 'data_source': expected a string, got {ds!r:.200}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}, column 'extra_info': expected a dict, got {extra!r:.200}")
    ground_truth = _ground_truth(row.get("reward_model"), where, float32_ground_truth)
    messages = prompt_messages(row.get(prompt_key), where, prompt_key)
    return {"data_source": ds, "ground_truth": ground_truth, "extra_info": extra or {}, "messages": messages}


def truncate(ids, max_len, mode):
    """Cut a prompt to max_len tokens: left keeps the end, right the start, middle both ends."""
    if len(ids) <= max_len:
        return ids
    head = {"left": 0, "middle": max_len // 2, "right": max_len}[mode]  # load_prompts checked the mode
    return ids[:head] + ids[len(ids) - (max_len - head):]  # head tokens from the start, the rest from the end


def load_prompts(files, tokenizer, *, prompt_key="prompt", max_prompt_length, truncation="error",
                 filter_overlong_prompts=False, max_samples=-1, chat_template_kwargs: dict | None = None):
    """Read parquet files in verl's schema (concatenated in order) and tokenize with the chat template. Each
    item: {prompt_ids, data_source, ground_truth, extra_info, messages}. Overlong prompts are dropped first
    (filter_overlong_prompts), then the first max_samples kept, then truncated.
    chat_template_kwargs: extra variables for the chat template, e.g. {"enable_thinking": False} (Qwen3)."""
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"unknown truncation mode {truncation!r}; use one of {TRUNCATION_MODES}")
    if max_prompt_length < 1:
        raise DataError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    files = [files] if isinstance(files, str) else list(files)
    check_parquet_schema(files, prompt_key)
    items, seen = [], 0
    limit = max_samples if max_samples > 0 else math.inf
    for f in files:
        if len(items) >= limit:
            break  # enough rows: skip reading and tokenizing the rest
        schema = pq.read_schema(f)
        cols = [c for c in ("data_source", prompt_key, "reward_model", "extra_info") if c in schema.names]
        float32_gt = pa.types.is_float32(schema.field("reward_model").type.field("ground_truth").type)
        for r, row in enumerate(pq.read_table(f, columns=cols).to_pylist()):
            if len(items) >= limit:
                break
            seen += 1
            item = parse_row(row, f"{f} row {r}", prompt_key, float32_ground_truth=float32_gt)
            try:
                ids = list(tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True,
                                                         tokenize=True, **(chat_template_kwargs or {})))
            except TemplateError as e:  # e.g. raise_exception on a role the template does not allow
                where = f"{f} row {r}"
                raise DataError(_template_rejects_row(e, where, item["messages"], tokenizer)) from None
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    continue
                if truncation == "error":
                    raise DataError(f"{f} row {r}: prompt is {len(ids)} tokens after the chat template, "
                                    f"longer than max_prompt_length={max_prompt_length}; set "
                                    "filter_overlong_prompts=True to drop such rows, or "
                                    "truncation=left/right/middle to cut them (or raise max_prompt_length)")
            item["prompt_ids"] = truncate(ids, max_prompt_length, truncation)
            items.append(item)
    if filter_overlong_prompts:
        print(f"filter_overlong_prompts: dropped {seen - len(items)} of {seen} prompts "
              f"longer than max_prompt_length={max_prompt_length} tokens")
        if not items:
            raise DataError(f"filter_overlong_prompts dropped all {seen} prompts in {files}; "
                            f"raise max_prompt_length or use truncation=left/right/middle instead")
    return items


def _template_rejects_row(e, where, messages, tokenizer):
    """The message for a chat template that raised (e.g. raise_exception on a role it does not allow) while
    templating the row `where`: the row, its roles, the template's own words and the fix."""
    roles = [m["role"] for m in messages]
    template_file = getattr(tokenizer, "chat_template_file", "the chat template")
    # jinja rewrites tracebacks to point into '<template>'; the innermost such frame is the failing line
    lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__) if fr.filename == "<template>"]
    at_line = f" at template line {lines[-1]}" if lines else ""
    if "system" in roles:
        edit = "fold the system message into the first user message"
    else:
        edit = "change or drop the messages whose roles it rejects"
    return (f"{where} (0-based): the chat template ({template_file}) rejects this row's messages, roles "
            f"{roles}: {type(e).__name__}{at_line}: {e}; edit the data (e.g. {edit}), or use a model whose "
            "chat template accepts those roles (or pass chat_template_kwargs if the template reads them)")


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
        rng = np.random.default_rng([self.seed, epoch])  # so any epoch's order can be rebuilt on resume
        self._perm = rng.permutation(self.num_prompts) if self.shuffle else np.arange(self.num_prompts)

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
                # roll over now: a state saved here resumes at the next epoch
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
    """Split sequence indices into as few micro-batches as fit max_token_len tokens each, balanced: longest
    first, each into the currently lightest micro-batch (if that one cannot take it, none can, so use one more
    micro-batch and start over). Indices ascending inside a micro-batch; micro-batches heaviest first, so an
    out-of-memory shows up on the first one."""
    for i, n in enumerate(lengths):
        if n > max_token_len:
            raise DataError(f"sequence {i} has {n} tokens but the micro-batch token budget is "
                            f"{max_token_len}; set ppo_max_token_len_per_gpu / "
                            "log_prob_max_token_len_per_gpu >= max_prompt_length + max_response_length")
    if min_num_micro_batches > len(lengths):
        raise DataError(f"cannot make {min_num_micro_batches} non-empty micro-batches from {len(lengths)} "
                        "sequences")
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, ties by index
    k = max(math.ceil(sum(lengths) / max_token_len), min_num_micro_batches, 1)  # the fewest that could fit
    while True:
        bins, loads = [[] for _ in range(k)], [0] * k
        for i in order:  # lightest bin, ties to the emptier then the first one
            b = min(range(k), key=lambda j: (loads[j], len(bins[j]), j))
            if loads[b] + lengths[i] > max_token_len:
                break
            bins[b].append(i)
            loads[b] += lengths[i]
        else:  # every sequence fit: indices ascending in each bin, bins heaviest first (ties by first index)
            return sorted((sorted(b) for b in bins), key=lambda b: (-sum(lengths[i] for i in b), b[0]))
        k += 1  # terminates: with one sequence per micro-batch everything fits


# -----------------------------------------------------------------------------
# tokenizer + chat template (tokenizers and jinja2; renders like transformers' apply_chat_template)

def read_json(path):
    """A model directory's JSON file as a dict; {} when the file is absent (hf.py reads config.json with it
    too)."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); copy the file again from the model's "
                        "source") from None


def _eos_token_ids(tok, eos_token, generation_config, config):
    """Generation stops at the tokenizer's eos_token plus generation_config.json's eos_token_id (an id or a
    list); without the latter, config.json's (as transformers' GenerationConfig.from_model_config). Unique, in
    order."""
    extra = generation_config.get("eos_token_id")
    if extra is None:
        extra = config.get("eos_token_id")
    if not isinstance(extra, list):
        extra = [extra]
    eos = tok.token_to_id(eos_token) if eos_token is not None else None  # None: not in the vocabulary
    return list(dict.fromkeys(i for i in [eos, *extra] if i is not None))


class Tokenizer:
    """A tokenizers.Tokenizer with the special tokens, stop ids and chat template of a model directory."""
    def __init__(self, tok, chat_template: str | None, special: dict, eos_token_ids: list[int],
                 chat_template_file: str = "the chat template"):
        self.tok = tok  # tokenizers.Tokenizer
        self.chat_template, self._template = chat_template, None  # compiled on first use
        self.chat_template_file = chat_template_file  # where the template came from, for error messages
        self.special = special  # bos_token, eos_token, pad_token, unk_token -> str
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}; nanodapo reads fast-tokenizer files "
                                    "(save the tokenizer with transformers' save_pretrained to produce one)")
        try:
            tok = tokenizers.Tokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
            raise DataError(f"{tj} cannot be loaded by tokenizers {tokenizers.__version__} ({e}); the file "
                            "is corrupt or truncated (copy it again from the model's source), or was written "
                            "by a newer tokenizers (pip install -U tokenizers)") from None
        tc_path = os.path.join(path, "tokenizer_config.json")
        tc = read_json(tc_path)
        # the chat template: tokenizer_config.json's, unless the directory has a chat_template.jinja
        template, template_file = tc.get("chat_template"), f"{tc_path} 'chat_template'"
        if isinstance(template, list):  # named templates: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template, template_file = f.read(), jinja_path
        special = {k: tc.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        # a special token given as an AddedToken dict -> its content string
        special = {k: t.get("content") if isinstance(t, dict) else t for k, t in special.items()}
        generation_config = read_json(os.path.join(path, "generation_config.json"))
        eos = _eos_token_ids(tok, special["eos_token"], generation_config,
                             read_json(os.path.join(path, "config.json")))
        if not eos:
            raise DataError(
                f"no stop token in {path!r}: tokenizer_config.json's eos_token {special['eos_token']!r} is "
                "missing or not in the vocabulary, and neither generation_config.json nor config.json has an "
                "eos_token_id, so every response would run to max_response_length; set eos_token in "
                "tokenizer_config.json to the end-of-turn token (e.g. '<|im_end|>') or eos_token_id in "
                "generation_config.json")
        return cls(tok, template, special, eos, template_file)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs):
        if self.chat_template is None:
            raise DataError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                            "chat_template.jinja); add one, or give prompts that are already templated")
        if self._template is None:
            try:
                self._template = _compile_template(self.chat_template)
            except TemplateSyntaxError as e:
                raise DataError(f"{self.chat_template_file} has a Jinja syntax error at template line "
                                f"{e.lineno}: {e.message}; fix the template there") from None
        ctx = {k: v for k, v in self.special.items() if v is not None}  # bos_token, eos_token, ...
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx,
                                     **kwargs)
        return self.encode(text) if tokenize else text

    def check_chat_template(self, chat_template_kwargs: dict | None = None):
        """Compile the chat template and render one user message with add_generation_prompt=True, as every
        prompt will be; a DataError with the Jinja error, its template line and the fix if either fails."""
        try:
            self.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                     **(chat_template_kwargs or {}))
        except DataError:
            raise
        except Exception as e:
            # anything the template raises (TemplateError, TypeError, ...) is its own fault. jinja rewrites
            # tracebacks to point into '<template>'; the innermost such frame is the failing line
            lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
            line = lines[-1] if lines else None
            raise DataError(f"{self.chat_template_file} fails on a one-message conversation with "
                            f"add_generation_prompt=True and chat_template_kwargs={chat_template_kwargs}: "
                            f"{type(e).__name__} at template line {line}: {e}; fix the template there, or "
                            "set chat_template_kwargs to the variables it expects") from None


def _compile_template(source: str):
    """The jinja environment of transformers' apply_chat_template, so templates render the same."""
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)
