"""
Rewards: rule verifiers by data_source (verl's interface and semantics), custom reward functions loaded from
a file, DAPO's overlong penalty, and a process pool that scores a batch with a per-response timeout.

    compute_score("math_dapo", "...\nAnswer: 42", "42")   # {'score': 1.0, 'acc': True, 'pred': '42'}
    reward_fn = "path/to/file.py:function_name"           # config: a custom function, same signature
"""
import contextlib
import ctypes
import importlib.util
import math
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"  # DAPO's prompt asks for a last line "Answer: $Answer"


class RewardError(ValueError):
    """Scoring cannot go on (a reward_fn that does not load, a data_source without a verifier, a reward
    function that failed on every response of a call or ran past its timeout on most of them); the message
    says which and how to fix it."""


class ScoringStopped(Exception):
    """A stop was requested (a signal) while scoring; the call's results are discarded, never trained on."""


# -----------------------------------------------------------------------------
# DAPO math (verl's math_dapo.py, Minerva-style normalization)

# applied in order, exactly as verl's math_dapo.SUBSTITUTIONS / REMOVED_EXPRESSIONS
SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots"]


def normalize_final_answer(final_answer: str) -> str:
    """Canonical form of a final answer; must stay identical to verl's math_dapo.normalize_final_answer."""
    s = final_answer.split("=")[-1]  # "x = 5" -> " 5": only the right-most side is the answer
    for before, after in SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        s = s.replace(expr, "")
    s = re.sub(r".*?\$(.*?)\$.*", r"$\1$", s)  # keep the first $...$ span of a line
    for command in ("text", "textbf", "overline"):  # \text{x} -> x, in verl's order
        s = re.sub(r"\\" + command + r"\{(.*?)\}", r"\1", s)
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
        pred = normalize_final_answer(found[-1]) if found else None  # None: no "Answer:" line at all
        correct = pred is not None and pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# -----------------------------------------------------------------------------
# GSM8K (verl's gsm8k.py) and the CPU demo's arithmetic task

GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's final answer, in solutions and in responses


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> dict:
    """GSM8K: score if correct, format_score if a number was found but is wrong, 0 if none was found.
    method strict: the last '#### <number>' (the trained format); flexible: the last number anywhere."""
    solution_str = solution_str[-300:]
    if method == "strict":
        found = GSM8K_ANSWER.findall(solution_str)
        pred = found[-1].replace(",", "").replace("$", "") if found else None
    else:
        assert method == "flexible", method
        found = re.findall(r"(\-?[0-9\.\,]+)", solution_str)
        numbers = [a for a in found if a != "."]
        if numbers:
            pred = numbers[-1]
        elif found:
            pred = found[0]  # only "." was found: verl keeps it as the prediction; it never matches
        else:
            pred = None
    correct = pred is not None and pred == ground_truth
    if correct:
        value = score
    elif pred is not None:
        value = format_score  # a number, but not the answer
    else:
        value = 0.0  # no number at all
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

# data_source -> rule verifier, as verl's default_compute_score dispatches; "aime*" sources are DAPO math too
VERIFIERS = {"math_dapo": math_dapo_score, "math": math_dapo_score, "math_dapo_reasoning": math_dapo_score,
             "openai/gsm8k": gsm8k_score, "gsm8k": gsm8k_score, "arith": arith_score}
AIME_PREFIX = "aime"


def _verifier(data_source: str):
    """The rule verifier for data_source; None if there is none."""
    if str(data_source).startswith(AIME_PREFIX):
        return math_dapo_score
    return VERIFIERS.get(data_source)


def check_data_sources(data_sources: set[str], reward_fn: str | None) -> None:
    """Before any work: with the built-in verifiers (reward_fn None) every data_source needs one. A custom
    reward_fn receives every data_source and decides for itself."""
    unknown = sorted((ds for ds in data_sources if _verifier(ds) is None), key=str)
    if reward_fn is None and unknown:
        raise RewardError(f"no verifier for data_source {', '.join(map(repr, unknown))}; known: "
                          f"{', '.join(VERIFIERS)}, {AIME_PREFIX}*. For another data source write a "
                          "function f(data_source, solution_str, ground_truth, extra_info=None) returning a "
                          "float or a dict with 'score' (and 'acc'), and "
                          'set reward_fn = "path/to/file.py:function_name" in the config.')


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """Score one response with the rule verifier for its data_source. ground_truth is one answer or a list of
    accepted answers (a numpy array from parquet too); the best-scoring one counts."""
    check_data_sources({data_source}, reward_fn=None)  # raises for a data_source without a verifier
    answers = ground_truth
    if hasattr(answers, "tolist"):  # a numpy array from parquet
        answers = answers.tolist()
    if not isinstance(answers, (list, tuple)):  # one answer
        answers = [answers]
    if not answers:
        raise ValueError("ground_truth is an empty list; a row needs at least one accepted answer")
    verify = _verifier(data_source)
    return max((verify(solution_str, str(a)) for a in answers), key=lambda r: r["score"])


def _import_failure(path: str, e: Exception) -> str:
    """Where in the file at path an import failed, and why: "line 3 ('import foo'): ModuleNotFoundError:
    ..."."""
    here = os.path.abspath(path)
    if isinstance(e, SyntaxError) and os.path.abspath(e.filename or "") == here:
        line, code = e.lineno, (e.text or "").strip()
    else:  # the innermost frame in the file itself, not in importlib or in what the file imports
        frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == here]
        if frames:
            line, code = frames[-1].lineno, frames[-1].line
        else:
            line, code = None, ""
    where = f"line {line} ({code!r})" if code else f"line {line}"
    return f"{where}: {type(e).__name__}: {e}"


def load_reward_fn(spec: str | None):
    """None -> compute_score; "path/to/file.py:function_name" -> that function, imported by path."""
    if spec is None:
        return compute_score
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise RewardError(f'reward_fn={spec!r} must look like "path/to/file.py:function_name"')
    if not os.path.isfile(path):
        raise RewardError(f"reward_fn={spec!r}: file {path!r} not found (relative to {os.getcwd()!r}); "
                          "give a path to an existing .py file")
    module_name = "reward_fn_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so dataclasses/pickle inside the file can find their module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardError(f"reward_fn={spec!r}: importing {path} failed at {_import_failure(path, e)}. Fix "
                          "the file, or install what it imports in this environment") from e
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"reward_fn={spec!r}: {path!r} has no function {name!r}; it defines {public}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"reward_fn={spec!r}: {name!r} is not callable (type {type(fn).__name__})")
    return fn


def normalize_result(result, fn_name: str) -> dict:
    """A reward function's float/int/bool or dict -> {score: float, acc: bool, pred}; anything else is an
    error."""
    out = dict(result) if isinstance(result, dict) else {"score": result}
    score = out.get("score")
    if hasattr(score, "item"):
        score = score.item()  # numpy / torch scalars
    if not isinstance(score, (int, float)) or not math.isfinite(score):
        raise RewardError(f"reward function {fn_name} returned {repr(result)[:200]}; it should return a "
                          "finite number or a dict with a finite 'score' (optional 'acc', 'pred')")
    return {"score": float(score), "acc": bool(out.get("acc", score > 0)), "pred": out.get("pred")}


def overlong_penalty(response_length: int, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then linear down to -factor at max."""
    if buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len={buffer_len} must be > 0 (or disable the overlong buffer)")
    if buffer_len > max_response_length:
        raise ValueError(f"overlong_buffer_len={buffer_len} is larger than max_response_length="
                         f"{max_response_length}; the penalty must start at a non-negative length")
    exceed = response_length - (max_response_length - buffer_len)  # < 0 before the buffer starts
    return min(-exceed / buffer_len * penalty_factor, 0.0)


# -----------------------------------------------------------------------------
# scoring a batch in worker processes, with a per-response timeout

_STARTUP_TIMEOUT_S = 120.0  # a fresh interpreter plus the custom file's own imports
_PARENT_POLL_S = 0.5  # how often a worker checks that the trainer is still its parent
_STOP_POLL_S = 0.2  # how often score() asks should_stop while it waits on the workers
_SOLUTION_SHOWN = 60  # characters of a solution_str quoted in a warning or an error
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SIGNAL_NAMES = {s.value: s.name for s in signal.Signals}


def _score_one(fn, fn_name: str, item) -> tuple[dict | None, str | None]:
    """(normalized result, None), or (None, why it failed) if the reward function failed."""
    data_source, solution_str, ground_truth, extra_info = item
    try:
        result = fn(data_source=data_source, solution_str=solution_str,
                    ground_truth=ground_truth, extra_info=extra_info)  # by keyword, as verl calls it
        return normalize_result(result, fn_name), None
    except RewardError as e:
        return None, str(e)
    except Exception as e:  # named with the innermost frame that raised it
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return None, (f"reward function {fn_name} raised {type(e).__name__}: {e} "
                      f"({frame.filename}:{frame.lineno} in {frame.name})")


def _watch_parent(parent_pid: int) -> None:
    """Exit once parent_pid is no longer this process's parent (an orphan is re-parented)."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _worker_main(fd: int, spec: str | None, parent_pid: int) -> None:
    """A worker's loop: load the reward function, then score chunks, reporting each item as it finishes."""
    # Ctrl-C and a launcher's SIGTERM to the process group are the trainer's to handle; it closes us
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    # die with the trainer even when it is SIGKILLed: Linux's parent-death signal, plus a watchdog thread for
    # systems without prctl and for a parent that died before prctl ran
    if sys.platform.startswith("linux"):
        # OSError, AttributeError: no libc symbols to load (static or unusual builds)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = multiprocessing.connection.Connection(fd)
    fn, fn_name = load_reward_fn(spec), spec or "compute_score"
    conn.send("ready")
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the trainer closed the pipe or exited
            return
        for item in chunk:
            conn.send(_score_one(fn, fn_name, item))


class _Worker:
    """One scoring process: a fresh interpreter (not multiprocessing.spawn, which would re-import the
    trainer script and torch) that imports only this file and the reward function."""
    def __init__(self, spec: str | None):
        parent, child = multiprocessing.Pipe()
        here = os.path.dirname(os.path.abspath(__file__))
        code = (f"import sys; sys.path.insert(0, {here!r}); import reward; "
                f"reward._worker_main({child.fileno()}, {spec!r}, {os.getpid()})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()])
        child.close()
        self.conn, self.ready, self.chunk = parent, False, deque()  # chunk: indices still to be scored
        self.deadline = time.monotonic() + _STARTUP_TIMEOUT_S

    def stop(self, grace_s: float = 0.0) -> int:
        """SIGKILL the process unless it exits within grace_s, reap it, close the pipe; its returncode."""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        return self.proc.returncode


def _describe_input(item) -> str:
    """Which response an item is, for a message: its data_source and the start of its solution_str."""
    data_source, solution_str = item[0], str(item[1])
    return f"data_source={data_source!r}, solution_str={solution_str[:_SOLUTION_SHOWN]!r}"


class _Call:
    """One score() call: results in input order, the failure counts, why each error happened and which
    responses timed out."""
    def __init__(self, items: list):
        self.items, self.results = items, [None] * len(items)
        self.stats = {"num_timeouts": 0, "num_errors": 0}
        self.num_scored = 0  # responses the reward function scored without failing
        self.errors = []  # one line per response that failed with an error
        self.timed_out = []  # indices of the responses that ran past the timeout, in the order they did

    def record(self, i: int, result: dict | None, why: str | None) -> None:
        """The outcome of _score_one for response i."""
        if why is None:
            self.results[i] = result
            self.num_scored += 1
        else:
            self.fail(i, "num_errors", why)

    def fail(self, i: int, counter: str, why: str | None = None) -> None:
        self.results[i] = {"score": 0.0, "acc": False, "pred": None}
        self.stats[counter] += 1
        if counter == "num_timeouts":
            self.timed_out.append(i)
        if why is not None:
            self.errors.append(f"{why} (data_source={self.items[i][0]!r})")


def _check_stop(should_stop, call: _Call) -> None:
    """Raise ScoringStopped if should_stop (None: never) asks for it."""
    if should_stop is not None and should_stop():
        raise ScoringStopped(f"a stop was requested while scoring {len(call.items)} responses; this call's "
                             "results are discarded")


class RewardScorer:
    """Scores (data_source, solution_str, ground_truth, extra_info) items in worker processes, so that a
    response that hangs (a pathological regex, a stuck custom function) is killed after timeout_s and one that
    crashes its worker costs only that response. num_workers=0 scores inline: no timeout, but a debugger
    works. Create it on a thread that outlives it: Linux's parent-death signal follows the creating thread."""
    def __init__(self, reward_fn: str | None = None, num_workers: int = 4, timeout_s: float = 10.0):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0 (0 scores inline, "
                             "without a timeout)")
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
        self.spec, self.fn_name = reward_fn, reward_fn or "compute_score"
        self.fn = load_reward_fn(reward_fn)  # fail at start-up, in this process, with a clear message
        self.timeout_s, self.inline = timeout_s, num_workers == 0
        self.workers = [_Worker(reward_fn) for _ in range(num_workers)]  # started once, reused every batch

    def score(self, items, should_stop=None) -> tuple[list[dict], dict]:
        """Results in input order, and {"num_timeouts", "num_errors"}: responses that scored 0 because they
        ran past timeout_s, or because the reward function raised, returned something unusable or killed its
        worker. One warning line per call with errors and one per call with timeouts. RewardError when every
        response failed with an error (the function is broken, not the data) or more than half ran past
        timeout_s; a function that hangs fails fast: max(4, 2 * num_workers) timeouts before the first
        response scored raise at once, without waiting n * timeout_s for the rest.
        should_stop: a callable polled while waiting on the workers (at least every 0.2 s) and between items
        inline, a varying number of times, so a local check and not a collective; once it returns True the
        call is abandoned with ScoringStopped."""
        if self.workers is None:
            raise RuntimeError("RewardScorer.score() after close()")
        call = _Call(list(items))
        if self.inline:
            for i, item in enumerate(call.items):
                _check_stop(should_stop, call)
                call.record(i, *_score_one(self.fn, self.fn_name, item))
        else:
            self._score_in_workers(call, should_stop)
        n, num_errors, num_timeouts = len(call.items), call.stats["num_errors"], call.stats["num_timeouts"]
        if num_errors == n > 0:
            raise RewardError(f"scoring failed for all {n} responses of this call; the first: "
                              f"{call.errors[0]}. Fix the function; RewardScorer(num_workers=0) runs it "
                              "inline for a debugger")
        if num_timeouts > n / 2:
            raise RewardError(self._timeouts_message(call, f"{num_timeouts} of {n} responses of this call"))
        if num_errors:
            print(f"warning: {num_errors} of {n} responses scored 0 because scoring failed; the first: "
                  f"{call.errors[0]}", file=sys.stderr, flush=True)
        if num_timeouts:
            print(f"warning: {num_timeouts} of {n} responses scored 0 because reward function {self.fn_name} "
                  f"ran past reward_timeout={self.timeout_s:g} s on them; the first: "
                  f"{_describe_input(call.items[call.timed_out[0]])}", file=sys.stderr, flush=True)
        return call.results, call.stats

    def _timeouts_message(self, call: _Call, how_many: str) -> str:
        """Why a call with too many timeouts stops, and what to do about it."""
        return (f"reward function {self.fn_name} ran past reward_timeout={self.timeout_s:g} s on {how_many}; "
                f"the first: {_describe_input(call.items[call.timed_out[0]])}. Raise reward_timeout if the "
                "function is just slow, make it faster, or fix a hang; reward_num_workers=0 "
                "(RewardScorer(num_workers=0)) scores inline for a debugger")

    def _score_in_workers(self, call: _Call, should_stop) -> None:
        """Score call.items in the workers: chunks of indices go to idle workers, each reports item by item;
        a worker past its deadline is replaced (its current response scores 0 as a timeout)."""
        n = len(call.items)
        size = max(1, math.ceil(n / (4 * len(self.workers))))  # a few chunks per worker balance load
        todo = deque(deque(range(s, min(s + size, n))) for s in range(0, n, size))
        max_timeouts_before_a_score = max(4, 2 * len(self.workers))  # then the function hangs, it is not slow
        try:
            while todo or any(w.chunk for w in self.workers):
                for w in self.workers:  # one IPC message per chunk, not per item
                    if w.ready and not w.chunk and todo:
                        w.chunk, w.deadline = todo.popleft(), time.monotonic() + self.timeout_s
                        try:
                            w.conn.send([call.items[i] for i in w.chunk])
                        except OSError:
                            # it died while idle: no response to blame, a fresh worker takes the chunk
                            self._replace(w, call, todo, None)
                # wait for a message from a busy (or starting) worker, or for the earliest deadline
                busy = [w for w in self.workers if w.chunk or not w.ready]
                timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
                if should_stop is not None:
                    timeout = min(timeout, _STOP_POLL_S)
                readable = multiprocessing.connection.wait([w.conn for w in busy], timeout)
                for w in busy:
                    if w.conn in readable:
                        self._receive(w, call, todo)
                    elif time.monotonic() > w.deadline:
                        if not w.ready:
                            raise RewardError(f"a reward worker for {self.fn_name} did not start within "
                                              f"{_STARTUP_TIMEOUT_S:.0f} s; num_workers=0 runs it inline")
                        self._replace(w, call, todo, "num_timeouts")
                        num_timeouts = call.stats["num_timeouts"]
                        if call.num_scored == 0 and num_timeouts >= max_timeouts_before_a_score:
                            raise RewardError(self._timeouts_message(
                                call, f"{num_timeouts} of the {n} responses of this call before scoring any "
                                "(stopped without waiting for the rest)"))
                _check_stop(should_stop, call)
        except BaseException:  # busy workers would report stale results into the next call
            for w in [w for w in self.workers if w.chunk]:
                self._replace(w, call, deque(), None)
            raise

    def _receive(self, w: _Worker, call: _Call, todo: deque) -> None:
        """Take one message from a worker; a worker that died scores its current response 0 as an error."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            rc = w.stop(grace_s=1.0)  # Popen's returncode: -N for signal N
            status = f"exit code {rc}" if rc >= 0 else f"killed by signal {_SIGNAL_NAMES.get(-rc, -rc)}"
            if not w.ready:
                raise RewardError(f"a reward worker for {self.fn_name} exited during start-up ({status}); "
                                  "its error is printed above; num_workers=0 runs it inline") from None
            why = f"reward function {self.fn_name} killed its worker process ({status})"
            return self._replace(w, call, todo, "num_errors", why)
        if msg == "ready":
            w.ready = True
            return
        call.record(w.chunk.popleft(), *msg)
        w.deadline = time.monotonic() + self.timeout_s  # the next response's clock starts now

    def _replace(self, w: _Worker, call: _Call, todo: deque, counter: str | None,
                 why: str | None = None) -> None:
        """Stop a stuck or dead worker, fail its current response under counter, requeue the rest of its
        chunk."""
        w.stop()
        if counter is not None and w.chunk:
            call.fail(w.chunk.popleft(), counter, why)
        if w.chunk:
            todo.appendleft(w.chunk)
        w.chunk = deque()
        self.workers[self.workers.index(w)] = _Worker(self.spec)

    def kill(self) -> None:
        """SIGKILL every worker and return without waiting: for a signal handler right before os._exit."""
        for w in self.workers or []:
            w.proc.kill()

    def close(self) -> None:
        """SIGKILL the workers (they hold nothing worth saving) and reap them; calling it again does
        nothing."""
        self.kill()
        workers, self.workers = self.workers or [], None
        for w in workers:
            w.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # a forgotten close() must not leave processes behind
        if getattr(self, "workers", None):
            self.close()
