"""
Rewards: rule verifiers by data_source (verl's interface and semantics), custom reward functions
loaded from a file, DAPO's overlong penalty, and a small process pool that scores a batch with a
per-call timeout.

    compute_score("math_dapo", "...\nAnswer: 42", "42")   # {'score': 1.0, 'acc': True, 'pred': '42'}
    reward_fn = "path/to/file.py:function_name"           # config: a custom function, same signature
"""

import importlib.util
import math
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections import deque

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"  # DAPO's prompt asks for a last line "Answer: $Answer"


class RewardError(ValueError):
    """A reward function failed or returned something unusable; the message says which and how to fix it."""


# -----------------------------------------------------------------------------
# DAPO math (verl's math_dapo.py, Minerva-style normalization)

# applied in order, exactly as verl's math_dapo.SUBSTITUTIONS / REMOVED_EXPRESSIONS
SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]


def normalize_final_answer(final_answer: str) -> str:
    """Canonical form of a final answer; must stay identical to verl's math_dapo.normalize_final_answer."""
    s = final_answer.split("=")[-1]  # "x = 5" -> " 5": only the right-most side is the answer
    for before, after in SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        s = s.replace(expr, "")
    s = re.sub(r".*?\$(.*?)\$.*", r"$\1$", s)  # keep the first $...$ span of a line
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\textbf\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\overline\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)  # \fracab -> \frac{a}{b}, \fracabc -> \frac{a}{b}c
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)  # \sqrta -> \sqrt{a}, \sqrtab -> \sqrt{a}b
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():  # "1,000" -> "1000", only for pure numbers
        s = s.replace(",", "")
    return s.strip()


def last_boxed_only_string(text: str) -> str | None:
    """The last '\\boxed{...}' in text with balanced braces, or None if there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if text[i] == "}" and depth == 0:
            return text[start:i + 1]
    return None


def math_dapo_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> dict:
    """DAPO math: +1 if the answer matches the ground truth, else -1 (invalid answers included)."""
    solution_str = solution_str[-300:]  # the answer sits at the end; bounds the regex cost (verl)
    if strict_box_verify:  # raw '\boxed{...}' content in the last 100 chars, compared unnormalized
        boxed = last_boxed_only_string(solution_str[-100:])
        pred = boxed[len("\\boxed{"):-1] if boxed is not None else None
        correct = pred == ground_truth
    else:
        found = re.findall(ANSWER_PATTERN, solution_str)
        pred = normalize_final_answer(found[-1] if found else "[INVALID]")
        correct = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# -----------------------------------------------------------------------------
# GSM8K (verl's gsm8k.py) and the CPU demo's arithmetic task

def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """strict: the last '#### <number>' (the trained format); flexible: the last number anywhere."""
    solution_str = solution_str[-300:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    assert method == "flexible", method
    found = re.findall(r"(\-?[0-9\.\,]+)", solution_str)
    numbers = [a for a in found if a != "."]
    if numbers:
        return numbers[-1]
    return found[0] if found else None  # verl's loop leaves a lone "." as the answer; it never matches


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> dict:
    """GSM8K: score if correct, format_score if a number was found but is wrong, 0 if none was found."""
    pred = extract_gsm8k_answer(solution_str, method)
    correct = pred is not None and pred == ground_truth
    value = score if correct else (format_score if pred is not None else 0.0)
    return {"score": float(value), "acc": correct, "pred": pred}


def arith_score(solution_str: str, ground_truth: str) -> dict:
    """The CPU demo task ("37+48=" -> "Answer: 85"): the last Answer: must be exactly that integer."""
    found = re.findall(ANSWER_PATTERN, solution_str)
    match = re.fullmatch(r"\s*([+-]?\d+)\s*", found[-1]) if found else None
    pred = match.group(1) if match else None
    correct = pred is not None and int(pred) == int(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# -----------------------------------------------------------------------------
# dispatch by data_source, custom functions, overlong penalty

KNOWN_DATA_SOURCES = "math_dapo, math, math_dapo_reasoning, aime*, openai/gsm8k, gsm8k, arith"


def _verifier(data_source: str):
    """The rule verifier for a data_source, as verl's default_compute_score picks it."""
    if data_source in ("math_dapo", "math", "math_dapo_reasoning") or str(data_source).startswith("aime"):
        return math_dapo_score
    if data_source in ("openai/gsm8k", "gsm8k"):
        return gsm8k_score
    if data_source == "arith":
        return arith_score
    raise ValueError(f"no verifier for data_source={data_source!r}; known: {KNOWN_DATA_SOURCES}. For another "
                     "data source write a function f(data_source, solution_str, ground_truth, extra_info=None) "
                     "returning a float or a dict with 'score' (and 'acc'), and set "
                     'reward_fn = "path/to/file.py:function_name" in the config.')


def _ground_truths(ground_truth) -> list[str]:
    """A ground truth is one answer or a list of accepted answers (numpy arrays from parquet too)."""
    if hasattr(ground_truth, "tolist"):
        ground_truth = ground_truth.tolist()
    answers = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    if not answers:
        raise ValueError("ground_truth is an empty list; a row needs at least one accepted answer")
    return [str(a) for a in answers]


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """Score one response with the rule verifier for its data_source; any accepted answer counts."""
    verify = _verifier(data_source)
    return max((verify(solution_str, gt) for gt in _ground_truths(ground_truth)), key=lambda r: r["score"])


def load_reward_fn(spec: str | None):
    """None -> compute_score; "path/to/file.py:function_name" -> that function, imported by path."""
    if spec is None:
        return compute_score
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f'reward_fn={spec!r} must look like "path/to/file.py:function_name"')
    if not os.path.isfile(path):
        raise ValueError(f"reward_fn={spec!r}: file {path!r} not found (relative to {os.getcwd()!r}); "
                         "give a path to an existing .py file")
    module_name = "reward_fn_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so dataclasses/pickle inside the file can find their module
    module_spec.loader.exec_module(module)
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward_fn={spec!r}: {path!r} has no function {name!r}; it defines {public}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"reward_fn={spec!r}: {name!r} is not callable (type {type(fn).__name__})")
    return fn


def normalize_result(result, fn_name: str) -> dict:
    """A reward function's float/int/bool or dict -> {score: float, acc: bool, pred}; anything else is an error."""
    hint = "it should return a finite number or a dict with a finite 'score' (optional 'acc', 'pred')"
    out = dict(result) if isinstance(result, dict) else {"score": result}
    score = out.get("score")
    if hasattr(score, "item"):
        score = score.item()  # numpy / torch scalars
    if not isinstance(score, (int, float)) or not math.isfinite(score):
        raise RewardError(f"reward function {fn_name} returned {repr(result)[:200]}; {hint}")
    acc = out.get("acc", score > 0)
    return {"score": float(score), "acc": bool(acc), "pred": out.get("pred")}


def overlong_penalty(response_length: int, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then linear down to -factor at max."""
    if buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len={buffer_len} must be > 0 (or disable the overlong buffer)")
    if buffer_len > max_response_length:
        raise ValueError(f"overlong_buffer_len={buffer_len} is larger than max_response_length="
                         f"{max_response_length}; the penalty must start at a non-negative length")
    expected = max_response_length - buffer_len
    exceed = response_length - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0)


# -----------------------------------------------------------------------------
# scoring a batch in worker processes, with a per-call timeout

_TIMED_OUT = {"score": 0.0, "acc": False, "pred": None}
_STARTUP_TIMEOUT_S = 120.0  # a fresh interpreter plus the custom file's own imports


def _score_one(fn, fn_name: str, item) -> tuple[dict | None, str | None]:
    """(normalized result, None), or (None, a message for the user) if the reward function failed."""
    data_source, solution_str, ground_truth, extra_info = item
    try:
        result = fn(data_source=data_source, solution_str=solution_str,
                    ground_truth=ground_truth, extra_info=extra_info)  # by keyword, as verl calls it
        return normalize_result(result, fn_name), None
    except RewardError as e:
        return None, f"{e} (data_source={data_source!r})"
    except Exception as e:
        return None, (f"reward function {fn_name} raised {type(e).__name__}: {e} (data_source={data_source!r}). "
                      f"Fix the function or its data; RewardScorer(num_workers=0) runs it inline for a debugger.\n"
                      f"--- worker traceback ---\n{traceback.format_exc()}")


def _worker_main(fd: int, spec: str | None) -> None:
    """A worker's loop: load the reward function, then score chunks, reporting each item as it finishes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes us
    conn = multiprocessing.connection.Connection(fd)
    fn, fn_name = load_reward_fn(spec), spec or "compute_score"
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the trainer closed the pipe or exited
            return
        for i, item in chunk:
            result, error = _score_one(fn, fn_name, item)
            conn.send(("result", i, result) if error is None else ("error", i, error))


class _Worker:
    """One scoring process: a fresh interpreter (not multiprocessing.spawn, which would re-import the
    trainer script and torch) that imports only this file and the reward function."""

    def __init__(self, spec: str | None):
        parent, child = multiprocessing.Pipe()
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; sys.path.insert(0, {here!r}); import reward; reward._worker_main({child.fileno()}, {spec!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()])
        child.close()
        self.conn, self.ready, self.chunk = parent, False, deque()  # chunk: indices still to be scored
        self.deadline = time.monotonic() + _STARTUP_TIMEOUT_S

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class RewardScorer:
    """Scores (data_source, solution_str, ground_truth, extra_info) items in a pool of worker processes so
    that a call that hangs (a pathological regex, a stuck custom function) can be killed after timeout_s.
    num_workers=0 scores inline in this process: no timeout, but a debugger and tracebacks work."""

    def __init__(self, reward_fn: str | None = None, num_workers: int = 4, timeout_s: float = 10.0):
        self.spec, self.fn_name = reward_fn, reward_fn or "compute_score"
        self.fn = load_reward_fn(reward_fn)  # fail at start-up, in this process, with a clear message
        self.timeout_s, self.inline = timeout_s, num_workers == 0
        self.workers = [_Worker(reward_fn) for _ in range(num_workers)]  # started once, reused every batch

    def score(self, items) -> tuple[list[dict], dict]:
        """Results in input order, and {"num_timeouts", "num_errors" (workers that died mid-call)}."""
        assert self.inline or self.workers, "RewardScorer.score() after close()"
        items = list(items)
        results, stats = [None] * len(items), {"num_timeouts": 0, "num_errors": 0}
        if self.inline:
            for i, item in enumerate(items):
                results[i], error = _score_one(self.fn, self.fn_name, item)
                if error is not None:
                    raise RewardError(error)
            return results, stats
        size = max(1, math.ceil(len(items) / (4 * len(self.workers))))  # a few chunks per worker balance load
        todo = deque(deque(range(s, min(s + size, len(items)))) for s in range(0, len(items), size))
        try:
            while todo or any(w.chunk for w in self.workers):
                for w in self.workers:  # one IPC message per chunk, not per item
                    if w.ready and not w.chunk and todo:
                        w.chunk = todo.popleft()
                        w.conn.send([(i, items[i]) for i in w.chunk])
                        w.deadline = time.monotonic() + self.timeout_s
                busy = [w for w in self.workers if w.chunk or not w.ready]
                timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
                readable = multiprocessing.connection.wait([w.conn for w in busy], timeout)
                for w in busy:
                    if w.conn in readable:
                        self._receive(w, results, stats, todo)
                    elif time.monotonic() > w.deadline:
                        if not w.ready:
                            raise RewardError(f"a reward worker for {self.fn_name} did not start within "
                                              f"{_STARTUP_TIMEOUT_S:.0f} s; num_workers=0 runs it inline")
                        self._replace(w, results, stats, todo, "num_timeouts")
        except BaseException:  # busy workers would report stale results into the next batch
            for w in [w for w in self.workers if w.chunk]:
                self._replace(w, results, stats, deque(), None)
            raise
        return results, stats

    def _receive(self, w: _Worker, results: list, stats: dict, todo: deque) -> None:
        """Take one message from a worker; a worker that died mid-item scores that item 0 like a timeout."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                raise RewardError(f"a reward worker for {self.fn_name} exited during start-up (exit code "
                                  f"{w.proc.wait()}); its error is printed above; num_workers=0 runs inline")
            return self._replace(w, results, stats, todo, "num_errors")
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "result":
            results[w.chunk.popleft()] = msg[2]
            w.deadline = time.monotonic() + self.timeout_s  # the next item's clock starts now
        else:
            raise RewardError(msg[2])

    def _replace(self, w: _Worker, results: list, stats: dict, todo: deque, counter: str | None) -> None:
        """Kill a stuck or dead worker, score its current item 0, requeue the rest, start a new worker."""
        w.kill()
        if counter is not None and w.chunk:
            results[w.chunk.popleft()] = dict(_TIMED_OUT)
            stats[counter] += 1
        if w.chunk:
            todo.appendleft(w.chunk)
        w.chunk = deque()
        self.workers[self.workers.index(w)] = _Worker(self.spec)

    def close(self) -> None:
        """Stop the workers (SIGKILL: they hold no state worth saving)."""
        for w in self.workers:
            w.kill()
        self.workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # a forgotten close() must not leave processes behind
        if getattr(self, "workers", None):
            self.close()
