"""The commands of a bash script as bash would expand them, without running anything.

`script_commands(text, env)` walks a launch script top to bottom and yields each simple
command as its list of words after expansion: variables (`$X`, `${X}`, `${X:-default}`,
`${X:=default}`, `${X:+alt}`, `${X%suffix}`, `${X#prefix}`, `${X/a/b}`, `${X,,}`, ...),
arithmetic (`$((a * 1024))`), quotes, backslash escapes, line continuations, values
over several lines, `~`, and word splitting of unquoted expansions. Assignments
(`X=...`, `export X=...`, arrays `A=(...)`, `"${A[@]}"`) update the environment as
they are met. `if` tests of the simple kinds (`[ "$a" = b ]`, `[[ $a == b ]]`, `-z`,
`-n`) pick their branch; other tests count as true. Command substitutions (`$(...)`,
backticks) are not run: `pwd` gives the working directory, `nproc` and GPU counts
give 8, `dirname`/`basename` of a plain word are computed, anything else expands to
the text `CMD`. Nothing is ever executed.
"""

from __future__ import annotations

import ast
import fnmatch
import operator
import os
import re
from collections.abc import Iterator

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?=)(.*)$", re.S)
KEYWORDS = {"then", "do", "else", "{", "}", "!", "time"}
REDIRECT = "<redirect>"  # a redirection whose target is the next word
REDIRECT_DONE = "<redirect-done>"  # one that names its target itself (`2>&1`)
SEPARATORS = {";", "&&", "||", "|", "&", "\n"}


# ------------------------------------------------------------------- lexing
def lex(text: str) -> list[str]:
    """Raw words and separators, quotes kept (expansion happens later); comments,
    line continuations and here-documents' bodies dropped."""
    tokens: list[str] = []
    i, n, word = 0, len(text), ""
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                i += 2
                continue
            word += text[i : i + 2]
            i += 2
        elif c in "'\"`":
            end = _closing(text, i)
            word += text[i : end + 1]
            i = end + 1
        elif c == "$" and text.startswith("$(", i):
            end = _matching_paren(text, i + 1)
            word += text[i : end + 1]
            i = end + 1
        elif c == "$" and text.startswith("${", i):
            end = _matching_brace(text, i + 1)
            word += text[i : end + 1]
            i = end + 1
        elif c == "(" and ASSIGN.match(word) and word.endswith("="):
            end = _matching_paren(text, i)
            word += text[i : end + 1]
            i = end + 1
        elif c == "#" and not word:
            while i < n and text[i] != "\n":
                i += 1
        elif c in " \t":
            word = _flush(tokens, word)
            i += 1
        elif c == "&" and text[i + 1 : i + 2] == ">":  # `&> file`
            word = _flush(tokens, word)
            tokens.append(REDIRECT)
            i += 3 if text[i + 2 : i + 3] == ">" else 2
        elif c == "\n" or c == ";" or c in "|&":
            word = _flush(tokens, word)
            op = text[i : i + 2] if text[i : i + 2] in ("&&", "||", ";;") else c
            tokens.append(op)
            i += len(op)
        elif c in "<>" and text.startswith("<<", i) and not text.startswith("<<<", i):
            word = _flush(tokens, word)
            i = _skip_heredoc(text, i)
        elif c in "<>":  # a redirection: `2>&1`, `> log`, `&> f`; it and its target go
            if word.isdigit():
                word = ""
            word = _flush(tokens, word)
            m = re.match(r"[<>]{1,2}&?(\d+|-)?", text[i:])
            tokens.append(REDIRECT if not (m.group(1)) else REDIRECT_DONE)
            i += m.end()
        else:
            word += c
            i += 1
    _flush(tokens, word)
    return tokens


def _flush(tokens: list[str], word: str) -> str:
    if word:
        tokens.append(word)
    return ""


def _closing(text: str, start: int) -> int:
    quote, i = text[start], start + 1
    while i < len(text):
        if text[i] == "\\" and quote != "'":
            i += 2
            continue
        if quote == '"' and text.startswith("$(", i):
            i = _matching_paren(text, i + 1) + 1
            continue
        if quote == '"' and text.startswith("${", i):
            i = _matching_brace(text, i + 1) + 1
            continue
        if text[i] == quote:
            return i
        i += 1
    return len(text) - 1


def _matching_paren(text: str, start: int) -> int:
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in "'\"" and text[i - 1] != "\\":
            i = _closing(text, i) + 1
            continue
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return i
        i += 1
    return len(text) - 1


def _matching_brace(text: str, start: int) -> int:
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        depth += c == "{"
        depth -= c == "}"
        if depth == 0:
            return i
        i += 1
    return len(text) - 1


def _skip_heredoc(text: str, i: int) -> int:
    m = re.match(r"<<-?\s*['\"]?(\w+)['\"]?", text[i:])
    if not m:
        return i + 2
    line_end = text.find("\n", i)
    end = re.search(rf"^\s*{m.group(1)}\s*$", text[line_end + 1 :], re.M)
    if line_end < 0 or end is None:
        return len(text)
    return line_end + 1 + end.end()


# --------------------------------------------------------------- expansion
class Shell:
    """An environment and the expansion of raw words in it."""

    def __init__(
        self, env: dict[str, str], script_path: str = "script.sh", args: list[str] = ()
    ) -> None:
        self.env: dict[str, str | list[str]] = dict(env)
        self.script_path = script_path
        self.args = list(args)  # the positional parameters $1, $2, ...

    def words(self, raw: str) -> list[str]:
        """The words one raw word expands to (unquoted expansions split on blanks)."""
        fields: list[list[tuple[str, bool]]] = [[]]
        self._expand_into(raw, fields, quoted=False)
        out = []
        for parts in fields:
            word = "".join(text for text, _ in parts)
            if word:  # an empty word ("$@" with no arguments, "") carries no override
                out.append(word)
        return out

    def string(self, raw: str) -> str:
        """`raw` expanded as one string (as on the right of an assignment)."""
        return " ".join(self.words(raw)) if raw else ""

    def _expand_into(self, raw: str, fields: list, quoted: bool) -> None:
        i, n = 0, len(raw)
        if not quoted and raw.startswith("~") and (n == 1 or raw[1] == "/"):
            fields[-1].append((str(self.env.get("HOME", "~")), True))
            i = 1
        while i < n:
            c = raw[i]
            if c == "\\" and i + 1 < n:
                nxt = raw[i + 1]
                if nxt == "\n":  # a line continuation
                    i += 2
                    continue
                if not quoted or nxt in '$`"\\':
                    fields[-1].append((nxt, True))
                else:
                    fields[-1].append((raw[i : i + 2], True))
                i += 2
            elif c == "'" and not quoted:
                end = raw.find("'", i + 1)
                end = n if end < 0 else end
                fields[-1].append((raw[i + 1 : end], True))
                fields[-1].append(("", True))  # '' still makes a word
                i = end + 1
            elif c == '"' and not quoted:
                end = _closing(raw, i)
                self._expand_into(raw[i + 1 : end], fields, quoted=True)
                fields[-1].append(("", True))
                i = end + 1
            elif c == "$" or c == "`":
                value, i, is_list = self._dollar(raw, i)
                self._add_value(value, fields, quoted, is_list)
            else:
                fields[-1].append((c, True))
                i += 1

    def _add_value(self, value, fields: list, quoted: bool, is_list: bool) -> None:
        if is_list:  # "${A[@]}" / $@: one word per element, even when quoted
            items = list(value)
            if not items:
                return
            fields[-1].append((items[0], True))
            for item in items[1:]:
                fields.append([(item, True)])
            return
        if quoted:
            fields[-1].append((value, True))
            return
        pieces = value.split()
        if not pieces:
            return
        if value[:1].isspace() and fields[-1]:
            fields.append([])
        fields[-1].append((pieces[0], True))
        for piece in pieces[1:]:
            fields.append([(piece, True)])
        if value[-1:].isspace():
            fields.append([])

    def _dollar(self, raw: str, i: int) -> tuple:
        """(value, index after it, whether it is a list of words) of the `$...` at i."""
        if raw[i] == "`":
            end = raw.find("`", i + 1)
            end = len(raw) if end < 0 else end
            return self._command(raw[i + 1 : end]), end + 1, False
        if raw.startswith("$((", i):
            end = _matching_paren(raw, i + 1)
            try:
                return str(self.arith(raw[i + 3 : end - 1])), end + 1, False
            except ValueError:  # bash reports the error (division by 0, ...); nothing expands
                return "", end + 1, False
        if raw.startswith("$(", i):
            end = _matching_paren(raw, i + 1)
            return self._command(raw[i + 2 : end]), end + 1, False
        if raw.startswith("${", i):
            end = _matching_brace(raw, i + 1)
            value, is_list = self._parameter(raw[i + 2 : end])
            return value, end + 1, is_list
        if raw.startswith("$'", i):
            end = raw.find("'", i + 2)
            return raw[i + 2 : end].encode().decode("unicode_escape"), end + 1, False
        m = NAME.match(raw, i + 1)
        if m:
            return self._scalar(m.group(0)), m.end(), False
        special = raw[i + 1 : i + 2]
        if special in ("@", "*"):
            return list(self.args), i + 2, True
        if special.isdigit():
            return self._positional(int(special)), i + 2, False
        if special == "#":
            return str(len(self.args)), i + 2, False
        if special in ("?", "$", "!", "-"):
            return "0", i + 2, False
        return "$", i + 1, False

    def _positional(self, k: int) -> str:
        if k == 0:
            return self.script_path
        return self.args[k - 1] if k <= len(self.args) else ""

    def _scalar(self, name: str) -> str:
        value = self.env.get(name, "")
        return " ".join(value) if isinstance(value, list) else value

    def _parameter(self, body: str) -> tuple:
        """`${body}`: a variable with its operator, as a (value, is_list) pair."""
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\[([@*])\]$", body)
        if m:
            value = self.env.get(m.group(1), [])
            return (value if isinstance(value, list) else value.split()), True
        if body.startswith("#"):
            return str(len(self._scalar(body[1:]))), False
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*|\d+|[@*])(.*)$", body, re.S)
        if not m:
            return "", False
        name, op = m.group(1), m.group(2)
        if name in ("@", "*"):
            return list(self.args), True
        if name.isdigit():
            is_set, value = 0 < int(name) <= len(self.args), self._positional(int(name))
        else:
            is_set, value = name in self.env, self._scalar(name)
        return self._operator(name, value, is_set, op), False

    def _operator(self, name: str, value: str, is_set: bool, op: str) -> str:
        for prefix, empty_counts in ((":-", True), ("-", False), (":=", True), ("=", False)):
            if op.startswith(prefix):
                unset = not is_set or (empty_counts and value == "")
                if not unset:
                    return value
                default = self.string(op[len(prefix) :])
                if "=" in prefix:
                    self.env[name] = default
                return default
        for prefix, empty_counts in ((":+", True), ("+", False)):
            if op.startswith(prefix):
                present = is_set and (value != "" or not empty_counts)
                return self.string(op[len(prefix) :]) if present else ""
        if op.startswith(":?") or op.startswith("?"):
            return value
        if op in (",,", ",") or op in ("^^", "^"):
            return value.lower() if op.startswith(",") else value.upper()
        for prefix, longest, from_end in (("%%", True, True), ("%", False, True)):
            if op.startswith(prefix):
                return _strip(value, self.string(op[len(prefix) :]), longest, from_end)
        for prefix, longest in (("##", True), ("#", False)):
            if op.startswith(prefix):
                return _strip(value, self.string(op[len(prefix) :]), longest, False)
        if op.startswith("/"):
            every = op.startswith("//")
            pattern, _, rep = op[2 if every else 1 :].partition("/")
            pattern, rep = self.string(pattern), self.string(rep)
            return value.replace(pattern, rep) if every else value.replace(pattern, rep, 1)
        if op.startswith(":"):  # ${X:offset:length}
            parts = op[1:].split(":")
            try:
                start = self.arith(parts[0])
                stop = start + self.arith(parts[1]) if len(parts) > 1 else None
                return value[start:stop]
            except ValueError:
                return value
        return value

    def _command(self, command: str) -> str:
        """What a command substitution would print, for the few commands scripts use."""
        words = command.strip().split()
        head = words[0] if words else ""
        if head == "pwd" or command.strip().startswith("cd ") and command.strip().endswith("pwd"):
            return str(self.env.get("PWD", "/workspace"))
        if head == "nproc" or "nvidia-smi" in command or "device_count" in command:
            return "8"
        if head in ("dirname", "basename", "realpath", "readlink") and len(words) >= 2:
            arg = self.string(words[-1])
            if head == "dirname":
                return os.path.dirname(arg) or "."
            if head == "basename":
                return os.path.basename(arg.rstrip("/"))
            return arg
        if head == "date":
            return "20260101-000000"
        if head in ("echo", "printf") and len(words) >= 2:
            return self.string(" ".join(words[1:]))
        return "CMD"

    def arith(self, expr: str) -> int:
        """bash arithmetic: integers, + - * / % ** and parentheses, names as variables."""
        text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expr)
        text = NAME.sub(lambda m: self._scalar(m.group(0)) or "0", text)
        text = text.replace("/", "//").replace("////", "//")
        try:
            return _eval(ast.parse(text.strip() or "0", mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as exc:
            raise ValueError(f"cannot evaluate $(({expr}))") from exc

    # ---------------------------------------------------------- commands
    def assign(self, word: str) -> bool:
        """Apply `word` if it is an assignment (`X=v`, `X+=v`, `A=(a b)`); True if it was."""
        m = ASSIGN.match(word)
        if not m:
            return False
        name, op, value = m.group(1), m.group(3), m.group(4)
        if value.startswith("(") and value.endswith(")"):
            items = [
                w for raw in lex(value[1:-1]) if raw not in SEPARATORS for w in self.words(raw)
            ]
            old = self.env.get(name, []) if op == "+=" else []
            self.env[name] = (old if isinstance(old, list) else [old]) + items
            return True
        expanded = self.string(value)
        if op == "+=":
            expanded = self._scalar(name) + expanded
        self.env[name] = expanded
        return True

    def test(self, words: list[str]) -> bool:
        """The value of a simple `[ ... ]` / `[[ ... ]]` test (unknown kinds: true)."""
        inner = [w for w in words if w not in ("[", "]", "[[", "]]", "test")]
        if len(inner) == 3 and inner[1] in NUMERIC_TESTS:
            try:
                a, b = int(inner[0] or 0), int(inner[2] or 0)
            except ValueError:
                return True
            return NUMERIC_TESTS[inner[1]](a, b)
        if len(inner) == 3 and inner[1] in ("=", "==", "!="):
            a, b = inner[0], inner[2]
            same = a == b or fnmatch.fnmatchcase(a, b)
            return same if inner[1] != "!=" else not same
        if len(inner) == 2 and inner[0] in ("-z", "-n"):
            return (inner[1] == "") == (inner[0] == "-z")
        if len(inner) == 1:
            return inner[0] != ""
        return True


NUMERIC_TESTS = {
    "-eq": operator.eq,
    "-ne": operator.ne,
    "-lt": operator.lt,
    "-le": operator.le,
    "-gt": operator.gt,
    "-ge": operator.ge,
}


def _strip(value: str, pattern: str, longest: bool, from_end: bool) -> str:
    cuts = range(len(value) + 1)
    order = cuts if (longest != from_end) else reversed(cuts)
    for k in order:
        part = value[k:] if from_end else value[:k]
        if fnmatch.fnmatchcase(part, pattern):
            return value[:k] if from_end else value[k:]
    return value


OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not integer arithmetic")


# ----------------------------------------------------------------- walking
def split_commands(tokens: list[str]) -> Iterator[list[str]]:
    """Raw words of each simple command, separators dropped."""
    command: list[str] = []
    skip = False
    for token in tokens:
        if token in SEPARATORS or token == ";;":
            if command:
                yield command
            command, skip = [], False
        elif token == REDIRECT:
            skip = True
        elif skip or token == REDIRECT_DONE:
            skip = False
        else:
            command.append(token)
    if command:
        yield command


def script_commands(
    text: str, env: dict[str, str], script_path: str, args: list[str] = ()
) -> Iterator[list[str]]:
    """Each command of the script that runs a program, as expanded words, in order
    (`args`: the script's positional parameters). An `exit` ends the walk."""
    shell = Shell(env, script_path, args)
    active: list[bool] = []  # one entry per open `if`: is the current branch taken?
    taken: list[bool] = []  # has a branch of that `if` been taken already?
    for raw in split_commands(lex(text)):
        head = raw[0]
        if head in ("if", "elif"):
            cond = shell.test([w for r in raw[1:] for w in shell.words(r)])
            if head == "if":
                active.append(cond)
                taken.append(cond)
            else:
                active[-1] = cond and not taken[-1]
                taken[-1] = taken[-1] or cond
            continue
        if head == "else" and active:
            active[-1] = not taken[-1]
            raw = raw[1:]
        if head == "fi" and active:
            active.pop()
            taken.pop()
            continue
        if not all(active):
            continue
        while raw and raw[0] in KEYWORDS:
            raw = raw[1:]
        if not raw or raw[0] in ("fi", "done", "esac", "}"):
            continue
        if raw[0] in ("export", "local", "declare", "readonly", "typeset"):
            for word in raw[1:]:
                if not word.startswith("-"):
                    shell.assign(word)
            continue
        if raw[0] == "exit":
            return
        if raw[0] == "shift":
            count = int(shell.string(raw[1])) if len(raw) > 1 else 1
            shell.args = shell.args[count:]
            continue
        if raw[0] == "for" and len(raw) >= 4 and raw[2] == "in":
            items = [w for r in raw[3:] if r not in ("do",) for w in shell.words(r)]
            shell.env[raw[1]] = items[0] if items else ""
            continue
        while raw and ASSIGN.match(raw[0]):
            shell.assign(raw[0])
            raw = raw[1:]
        if raw:
            yield [w for r in raw for w in shell.words(r)]
