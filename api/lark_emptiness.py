"""Whether a Lark grammar (llguidance's dialect, or a GBNF grammar once converted) admits any text.

llguidance compiles a grammar whose language is empty without complaint: `start: a` with
`a: "x" a` has no finite derivation, yet every prefix `xxx...` stays viable, so a constrained row
writes `x` until its matcher gives up and the answer ends `stop`. Emptiness of a context-free
grammar is decidable by the textbook fixpoint: a rule is *productive* when one of its alternatives
needs only literals, regexes and productive rules (an optional or starred item needs nothing); the
language is empty exactly when `start` is not productive.

`unproductive(text)` reads just enough of the grammar for that: definitions (rules and terminals),
alternatives, groups, optional and repeated items. It fails open: whatever it does not understand
(templates, a `%` directive inside a rule other than `%json` / `%regex`, an unbalanced bracket)
makes it answer None (no verdict), never a refusal of a grammar llguidance would serve. Regexes,
`%json` and `%regex` blocks and special tokens count as productive (the compiler and the matcher's
first mask judge those, `grammar_compile.py`).
"""

from __future__ import annotations

import re

_DEF = re.compile(r"[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*(\[[^\]\n]*\])?[ \t]*:(?![:=])")
_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|//[^\n]*|\#[^\n]*)
  | (?P<str>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<rx>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><[^>\n]*>)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<num>\d+)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<punct>[|()\[\]?*+~{},&])
  | (?P<pct>%(?:json|regex)\b)
    """,
    re.X,
)

_Seq = list  # [(atom, optional)]: atom is a rule name (str), True (a literal) or a group (list of _Seq)


class _Unreadable(Exception):
    pass


def unproductive(text: str) -> list[str] | None:
    """The rules reachable from `start` that can never finish (empty: the grammar admits text;
    None: no verdict, see the module docstring). Non-empty exactly when `start` admits nothing."""
    try:
        rules = _definitions(text)
    except _Unreadable:
        return None
    if "start" not in rules:
        return None
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and _alt_ok(body, rules, productive):
                productive.add(name)
                changed = True
    if "start" in productive:
        return []
    reach, stack = set(), ["start"]
    while stack:
        name = stack.pop()
        if name in reach or name not in rules:
            continue
        reach.add(name)
        stack += _refs(rules[name])
    return sorted(n for n in reach if n not in productive)


def _alt_ok(alts: list[_Seq], rules: dict, productive: set[str]) -> bool:
    return any(all(opt or _atom_ok(atom, rules, productive) for atom, opt in seq) for seq in alts)


def _atom_ok(atom, rules: dict, productive: set[str]) -> bool:
    if atom is True:
        return True
    if isinstance(atom, str):  # NOTE: an undefined name (`%import common.X`) is taken as productive
        return atom in productive or atom not in rules
    return _alt_ok(atom, rules, productive)


def _refs(alts: list[_Seq]) -> list[str]:
    out: list[str] = []
    for seq in alts:
        for atom, _ in seq:
            if isinstance(atom, str):
                out.append(atom)
            elif isinstance(atom, list):
                out += _refs(atom)
    return out


def _definitions(text: str) -> dict[str, list[_Seq]]:
    """Each definition's alternatives; a name defined twice keeps both definitions' alternatives."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    directive_depth = 0  # open braces of a multi-line `%llguidance {...}` or similar directive
    for line in text.splitlines():
        if directive_depth:
            directive_depth += _braces(line)
            continue
        stripped = line.lstrip()
        if stripped.startswith("%"):
            current = None
            directive_depth = max(0, _braces(line))
            continue
        m = _DEF.match(line)  # NOTE: lexeme options (`name[lazy]:`) do not change what it admits
        if m is not None:
            current = bodies.setdefault(m.group(1), [])
            current.append(line[m.end() :])
        elif current is not None:
            current.append(line)
        elif stripped and not stripped.startswith(("//", "#")):
            raise _Unreadable(line)
    return {name: _Parser("\n".join(parts)).alternatives() for name, parts in bodies.items()}


def _braces(line: str) -> int:
    return line.count("{") - line.count("}")


class _Parser:
    """Alternatives of one definition's body (tokens from `_TOKEN`)."""

    def __init__(self, body: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(body):
            m = _TOKEN.match(body, pos)
            if m is None:
                raise _Unreadable(body[pos : pos + 20])
            kind = m.lastgroup or ""
            if kind == "pct":
                end = _json_end(body, m.end())
                self.tokens.append(("lit", body[pos:end]))
                pos = end
                continue
            if kind != "ws":
                self.tokens.append((kind, m.group()))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        self.i += 1
        return tok

    def alternatives(self) -> list[_Seq]:
        alts = self._alts()
        if self.peek()[0] != "end":
            raise _Unreadable(self.peek()[1])
        return alts

    def _alts(self) -> list[_Seq]:
        alts = [self._seq()]
        while self.peek() == ("punct", "|"):
            self.take()
            alts.append(self._seq())
        return alts

    def _seq(self) -> _Seq:
        seq: _Seq = []
        while True:
            kind, value = self.peek()
            if kind == "arrow":  # `-> alias` ends the alternative
                self.take()
                self.take()
                return seq
            if kind in ("end",) or value in ("|", ")", "]"):
                return seq
            if value == "&":  # `A & B`: both must match (read as a sequence: both needed)
                self.take()
                continue
            if value == "~" and not seq:  # prefix negation of a lexeme: matches something
                self.take()
            seq.append(self._item())

    def _item(self) -> tuple[object, bool]:
        kind, value = self.take()
        atom: object
        optional = False
        if kind in ("str", "rx", "special", "lit"):
            atom = True
            if kind == "str" and self.peek()[0] == "range":
                self.take()
                self.take()
        elif kind == "name":
            atom = value
        elif value == "(":
            atom = self._alts()
            self._expect(")")
        elif value == "[":
            atom, optional = self._alts(), True
            self._expect("]")
        elif value == "~":  # `~A` inside a sequence: a lexeme's negation
            atom = True
            self._item()
        else:
            raise _Unreadable(value)
        kind, value = self.peek()
        if value in ("?", "*", "+"):
            self.take()
            optional = optional or value != "+"
        elif value == "~":  # `x ~ n` or `x ~ n..m`
            self.take()
            optional = optional or self._count() == 0
        elif value == "{":  # `x{n}` or `x{n,m}` (llguidance)
            self.take()
            optional = optional or self._count() == 0
            while self.peek()[1] != "}":
                if self.peek()[0] == "end":
                    raise _Unreadable("{")
                self.take()
            self.take()
        return atom, optional

    def _count(self) -> int:
        kind, value = self.take()
        if kind != "num":
            raise _Unreadable(value)
        if self.peek()[0] == "range":
            self.take()
            self.take()
        return int(value)

    def _expect(self, value: str) -> None:
        if self.take()[1] != value:
            raise _Unreadable(value)


def _json_end(body: str, pos: int) -> int:
    """The end of the `{...}` block after `%json` / `%regex` at `pos` (strings skipped)."""
    start = body.find("{", pos)
    if start < 0 or body[pos:start].strip():
        raise _Unreadable(body[pos : pos + 20])
    depth, i, in_str = 0, start, False
    while i < len(body):
        ch = body[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _Unreadable("%json")
