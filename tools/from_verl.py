"""
A verl launch script -> a nanodapo config file, through verl_keys.VERL_KEYS:

    python tools/from_verl.py run_dapo_qwen2.5_32b.sh > configs/my_run.py
    MODEL_PATH=~/models/Qwen2.5-7B python tools/from_verl.py run.sh > configs/my_run.py   # variables it reads
    python tools/from_verl.py run.sh trainer.nnodes=2 > configs/my_run.py                 # the script's "$@"

The script is read as bash would expand it, without running anything: variables with ${VAR:-default},
${VAR:=default}, ${VAR-default}, $((...)) integer arithmetic, quoting, line continuations, `export`; the
launch command is `python3 -m verl.trainer.main_ppo`, `python3 -m recipe.dapo.main_dapo` (or any
verl/recipe main module), alone or after `ray job submit ... --`. The config file has one line per setting with
the verl key it came from, verl's defaults where nanodapo's differ (so the run is the verl run), the refused
keys with their reasons at the top, and the torchrun line; then the dry run's config check runs on it and its
verdict goes to stderr (exit 1 if the check fails). Unknown keys stop it (exit 2), naming the closest key.
"""
import ast
import contextlib
import dataclasses
import operator
import os
import re
import sys
import tempfile

import config
import plan
import verl_keys
from train_dapo import Config

LAUNCHER = re.compile(r"(verl|recipe)(\.\w+)*\.main\w*|.*/main_\w+\.py")


class ScriptError(ValueError):
    """A launch script this tool cannot read as bash would; the message names the line and the fix."""


# -----------------------------------------------------------------------------
# reading a launch script as bash expands it

def launch_words(text: str, env: dict, args: list[str]) -> tuple[list[str], str]:
    """The words after the verl launcher's module, expanded -> (overrides, the launcher's module)."""
    variables = dict(env)
    for lineno, command in commands(text):
        try:
            words = expand_words(command, variables, args)
        except ScriptError as e:
            raise ScriptError(f"line {lineno}: {e}") from None
        if not words:
            continue
        if all(re.fullmatch(r"(export\s+)?[A-Za-z_]\w*=.*", w, re.S) or w == "export" for w in words):
            for w in words:
                name, _, value = w.removeprefix("export").strip().partition("=")
                if name:
                    variables[name] = value
            continue
        for i, w in enumerate(words):
            module = words[i + 1] if w == "-m" and i + 1 < len(words) else w
            if LAUNCHER.fullmatch(module) and (w == "-m" or w.endswith(".py")):
                rest = words[i + 2 if w == "-m" else i + 1:]
                return [r.strip() for r in rest if r.strip()], module
    raise ScriptError("no verl launch command found (python3 -m verl.trainer.main_ppo, "
                      "python3 -m recipe.dapo.main_dapo, or ray job submit ... -- python3 -m ...)")


def commands(text: str):
    """(line number, command text) for each command: continuation lines joined, comments dropped, split at
    newlines and ; && || | outside quotes."""
    text = text.replace("\r\n", "\n")
    lineno, start, cur, quote, i = 1, 1, "", None, 0
    while i < len(text):
        c = text[i]
        if c == "\\" and text[i + 1:i + 2] == "\n" and quote != "'":  # a continuation line
            lineno, i = lineno + 1, i + 2
            continue
        if c == "\\" and quote != "'":  # an escaped character stays for expand_words
            cur, i = cur + text[i:i + 2], i + 2
            continue
        if quote:
            quote = None if c == quote else quote
            cur += c
        elif c in "'\"":
            quote, cur = c, cur + c
        elif c == "#" and (not cur or cur[-1] in " \t"):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c in "\n;|" or text[i:i + 2] == "&&":
            yield start, cur
            cur = ""
            i += 2 if text[i:i + 2] in ("&&", "||") else 1
            lineno += c == "\n"
            start = lineno
            continue
        else:
            cur += c
        lineno += c == "\n"  # a newline inside quotes
        i += 1
    yield start, cur


def expand_words(command: str, variables: dict, args: list[str]) -> list[str]:
    """bash's word expansion of one command: quotes removed, $VAR / ${...} / $((...)) expanded, "$@" the
    script's arguments; redirections dropped."""
    words, cur, has_word, i = [], "", False, 0
    s = command
    while i < len(s):
        c = s[i]
        if c in " \t\r":
            if has_word:
                words.append(cur)
            cur, has_word = "", False
            i += 1
        elif c == "'":
            j = s.find("'", i + 1)
            if j < 0:
                raise ScriptError("unterminated single quote")
            cur, has_word, i = cur + s[i + 1:j], True, j + 1
        elif c == '"':
            j, part = i + 1, ""
            while j < len(s) and s[j] != '"':
                if s[j] == "\\" and j + 1 < len(s) and s[j + 1] in '"\\$`':
                    part, j = part + s[j + 1], j + 2
                elif s[j] == "$":
                    if s[j:j + 2] == "$@":
                        part, j = part + " ".join(args), j + 2
                        continue
                    value, j = expand_dollar(s, j, variables, args)
                    part += value
                else:
                    part, j = part + s[j], j + 1
            if j >= len(s):
                raise ScriptError("unterminated double quote")
            cur, has_word, i = cur + part, True, j + 1
        elif c == "\\":
            cur, has_word, i = cur + s[i + 1:i + 2], True, i + 2
        elif c == "$":
            if s[i:i + 2] in ("$@", "$*"):
                words += ([cur] if has_word else []) + list(args)
                cur, has_word, i = "", False, i + 2
                continue
            value, i = expand_dollar(s, i, variables, args)
            cur, has_word = cur + value, True
        elif c == "`":
            raise ScriptError("command substitution `...` is not run; write its value into the script or "
                              "set the variable in the environment")
        elif re.match(r"\d*(>>?|<)&?\d*", s[i:]) and not has_word or c in "<>":
            m = re.match(r"\d*(>>?|<)&?\d*\s*", s[i:])
            i += m.end()
            if not re.match(r"\d*(>>?|<)&\d", m.group(0)):  # > file: drop the file's word too
                while i < len(s) and s[i] not in " \t":
                    i += 1
        else:
            cur, has_word, i = cur + c, True, i + 1
    if has_word:
        words.append(cur)
    return words


def expand_dollar(s: str, i: int, variables: dict, args: list[str]) -> tuple[str, int]:
    """The expansion starting at s[i] == '$' -> (its value, the index after it)."""
    if s.startswith("$((", i):
        j = matching(s, i + 1, "(", ")")
        return str(arithmetic(s[i + 3:j - 1], variables, args)), j + 1
    if s.startswith("$(", i):
        raise ScriptError(f"command substitution {s[i:matching(s, i + 1, '(', ')') + 1]} is not run; write its "
                          "value into the script or set the variable in the environment")
    if s.startswith("${", i):
        j = matching(s, i + 1, "{", "}")
        return parameter(s[i + 2:j], variables, args), j + 1
    m = re.match(r"[A-Za-z_]\w*|\d|#", s[i + 1:])
    if not m:
        return "$", i + 1
    return lookup(m.group(0), variables, args), i + 1 + m.end()


def matching(s: str, i: int, open_: str, close: str) -> int:
    """The index of the bracket closing the one at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] == open_) - (s[j] == close)
        if depth == 0:
            return j
    raise ScriptError(f"unclosed {open_} in {s[i - 1:i + 40]!r}")


def lookup(name: str, variables: dict, args: list[str]) -> str:
    if name.isdigit():
        return args[int(name) - 1] if 0 < int(name) <= len(args) else ""
    if name == "#":
        return str(len(args))
    return variables.get(name, "")


def parameter(body: str, variables: dict, args: list[str]) -> str:
    """${NAME}, ${NAME:-word}, ${NAME-word}, ${NAME:=word}, ${NAME=word}, ${NAME:+word}."""
    m = re.fullmatch(r"([A-Za-z_]\w*|\d+)(:?[-=+])?(.*)", body, re.S)
    if not m:
        raise ScriptError(f"${{{body}}}: only ${{VAR}}, ${{VAR:-default}}, ${{VAR:=default}} and "
                          "${VAR:+word} are read")
    name, op, word = m.groups()
    value = lookup(name, variables, args)
    is_set = name in variables if not name.isdigit() else int(name) <= len(args)
    empty = not is_set or (op or "").startswith(":") and value == ""
    if not op:
        return value
    if op.endswith("+"):
        return "" if empty else " ".join(expand_words(word, variables, args))
    if not empty:
        return value
    default = " ".join(expand_words(word, variables, args))
    if op.endswith("="):
        variables[name] = default
    return default


# bash's integer arithmetic: division and remainder truncate toward zero, as in C
ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow,
              ast.LShift: operator.lshift, ast.RShift: operator.rshift,
              ast.Div: lambda a, b: int(a / b), ast.FloorDiv: lambda a, b: int(a / b),
              ast.Mod: lambda a, b: a - b * int(a / b)}


def arithmetic(expr: str, variables: dict, args: list[str]) -> int:
    """bash's $((...)): integers, + - * / % ** << >>, parentheses, variables with or without $."""
    text = re.sub(r"\$\{?([A-Za-z_]\w*|\d)\}?", lambda m: lookup(m.group(1), variables, args) or "0", expr)

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            raw = variables.get(node.id, "0") or "0"
            return arithmetic(raw, variables, args)
        if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
            return ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ScriptError(f"$(({expr})): only integer + - * / % ** << >> and parentheses are read")
    try:
        return value(ast.parse(text.replace("/", "//").strip(), mode="eval").body)
    except SyntaxError:
        raise ScriptError(f"$(({expr})) is not integer arithmetic") from None


# -----------------------------------------------------------------------------
# writing the config file

def overrides(words: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """The launcher's words -> ([(verl key, raw value)], Hydra's own options (--config-name, ...))."""
    pairs, hydra = [], []
    skip = False
    for w in words:
        if skip:
            hydra[-1] += " " + w
            skip = False
        elif w.startswith(("--config-path", "--config-name", "--config-dir", "-cn", "-cp")):
            hydra.append(w)
            skip = "=" not in w
        elif "=" in w:
            key, _, raw = w.partition("=")
            pairs.append((key, raw))
        else:
            raise ScriptError(f"{w!r} after the launcher is not a key=value override")
    return pairs, hydra


def literal(value) -> str:
    """A value as Python source; paths under the home directory as os.path.expanduser("~/...")."""
    home = os.path.expanduser("~")
    if isinstance(value, str) and value.startswith(home + os.sep):
        return f'os.path.expanduser("~{value[len(home):]}")'
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(map(literal, value)) + "]"
    return repr(value)


def render(t, script: str, module: str, hydra: list[str], out_name: str) -> str:
    """The config file of a translation."""
    defaults = Config()
    set_fields = {**{f: (v, f"verl's default: {k}") for f, (v, k) in t.defaults.items()},
                  **{f: (v, k) for f, (v, k) in t.fields.items()}}
    nnodes = set_fields.get("nnodes", (1,))[0]
    gpus = set_fields.get("n_gpus_per_node", (defaults.n_gpus_per_node,))[0]
    run = f"torchrun --nproc-per-node {gpus} train_dapo.py {out_name}"
    if nnodes > 1:
        run = (f"torchrun --nnodes {nnodes} --nproc-per-node {gpus} --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
               f"train_dapo.py {out_name}")
    lines = [f"# Translated from the verl launch script {os.path.basename(script)} ({module}) by "
             "tools/from_verl.py.", "#", "# Run" + (" on every node (HOST:PORT = an address of node 0 that all "
                                                     "nodes reach):" if nnodes > 1 else ":"),
             f"#   {run}", f"# Check it first, without GPUs: python train_dapo.py {out_name} --dry_run", "#"]
    if t.refused:
        lines.append("# verl keys nanodapo does not take (left out; the run below differs from verl's there):")
        lines += [f"# - {k}={raw}: {why}" for k, raw, why in t.refused]
    if t.noops or hydra:
        lines.append("# verl keys that change nothing here:")
        lines += [f"# - {k}={raw}: {why}" for k, raw, why in t.noops]
        lines += [f"# - {h}: verl's Hydra config choice; the keys and verl's defaults below are the run"
                  for h in hydra]
    lines += ["# Lines marked \"verl's default\" are fields the script left to verl, whose default differs from "
              "nanodapo's.", "# Performance knobs keep nanodapo's defaults (gradient_checkpointing, compile, "
              "gen_tp, max_num_seqs, ...).", ""]
    body = []
    for f in dataclasses.fields(Config):
        if f.name in set_fields:
            value, source = set_fields[f.name]
            if f.name == "vllm_kwargs":
                value = {**defaults.vllm_kwargs, **value}
            body.append(f"{f.name} = {literal(value)}  # {source}")
    if any("os.path.expanduser" in line for line in body):
        lines += ["import os", ""]
    return "\n".join(lines + body) + "\n"


def check(text: str, name: str) -> str:
    """The dry run on a config file's text -> its verdict (its report goes to stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write(text)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                cfg, _ = config.parse_args(Config, [path])
                plan.dry_run(cfg)
        except config.ConfigError as e:
            return f"dry run: FAILED: {e}"
    return "dry run: config OK"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    try:
        with open(script) as f:
            words, module = launch_words(f.read(), dict(os.environ), args)
        pairs, hydra = overrides(words)
    except (OSError, ScriptError) as e:
        print(f"{script}: {e}", file=sys.stderr)
        return 2
    t = verl_keys.translate(pairs, [f.name for f in dataclasses.fields(Config)], verl_defaults=True,
                            base=vars(Config()))
    if t.unknown:
        print(f"{script}: unknown keys:\n  " + "\n  ".join(t.problems()[len(t.refused):]), file=sys.stderr)
        return 2
    out_name = "configs/" + re.sub(r"\W+", "_", os.path.splitext(os.path.basename(script))[0]) + ".py"
    text = render(t, script, module, hydra, out_name)
    sys.stdout.write(text)
    sys.stdout.flush()
    print(f"{len(pairs)} verl keys: {len(t.translated)} translated, {len(t.noops)} no-op, {len(t.refused)} "
          f"refused" + "".join(f"\n  refused {k}: {why}" for k, _, why in t.refused), file=sys.stderr)
    verdict = check(text, os.path.basename(out_name))
    print(verdict, file=sys.stderr)
    return 0 if verdict.endswith("config OK") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
