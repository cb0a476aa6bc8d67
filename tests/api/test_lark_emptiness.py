"""Which grammars admit no text (`api/lark_emptiness.py`, `api/grammar_compile.check`): the
fixpoint names exactly the rules that never finish, reads llguidance's extensions, and gives no
verdict (never a refusal) on what it cannot read; the caps' counts (`ringserve/rules.py`)."""

from __future__ import annotations

import llguidance
import pytest
from llguidance.gbnf_to_lark import any_to_lark

from ringserve import rules
from ringserve.api.grammar_compile import Refused, check, to_grammar
from ringserve.api.lark_emptiness import unproductive

# llama.cpp's json.gbnf (MIT), as llguidance's tests carry it: a real grammar that admits text
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""


@pytest.mark.parametrize(
    "lark, never",
    [
        ('start: a\na: "x" a\n', ["a", "start"]),
        ('start: "x" a\na: "y" a\n', ["a", "start"]),
        ('start: ("x" start)\n', ["start"]),
        ('start: A\nA: "x" A\n', ["A", "start"]),
        ('start: a+\na: "x" a\n', ["a", "start"]),
        ('start: x{2,3}\nx: "a" x\n', ["start", "x"]),
        ('start: a // a comment\na: "x" a # another\n', ["a", "start"]),
        ('start: "x\\"" a\na: "y" a\n', ["a", "start"]),
        ('start: "x" /a\\/b/ a\na: "y" a\n', ["a", "start"]),
        ('%llguidance {\n "no_forcing": true\n}\nstart: b\nb: "x" b\n', ["b", "start"]),
        ('start: a\na: "x" a | "y"\n', []),
        ('start: a*\na: "x" a\n', []),
        ('start: [a] "z"\na: "x" a\n', []),
        ('start: (a | "q") "z"\na: "x" a\n', []),
        ('start: x{0,3}\nx: "a" x\n', []),
        ('start: x ~ 0..3\nx: "a" x\n', []),
        ('start: "a" %json {\n "type": "object", "properties": {"a": {"type": "string"}}\n} "b"\n', []),
        ("%llguidance {}\nstart: /[a-z]+/ | start\n", []),
        ('start: foo\nfoo[lazy]: TEXT "<f"\nTEXT: /.*/\n', []),
        ("start: <|im_end|> | a\na: a\n", []),
        ('start: expr\n?expr: expr "+" term | term\nterm: /[0-9]+/ -> num\n', []),
        ('start: "a".."z"\n', []),
        ("start: WS\n%import common.WS\n", []),
        ("start: ASCII\nASCII: /[a-z\\n]*/ & ~/x/\n", []),
        (any_to_lark(JSON_GBNF), []),
        ("start: foo{x}\nfoo{x}: x\n", None),  # a template: no verdict
        ("no rules at all", None),
    ],
)
def test_unproductive_rules(lark, never):
    """The rules reachable from `start` that never finish; None where the grammar is not read."""
    assert unproductive(lark) == never


def test_the_compile_check_passes_grammars_that_admit_text(codec):
    """The emptiness checks refuse nothing that admits text (an empty answer included), and
    refuse what admits nothing."""
    tok = llguidance.LLTokenizer(codec.tokenizer.to_str(), n_vocab=codec.vocab_size)
    for kind, value in [
        ("grammar", 'start: a\na: "x" a | "y"\n'),
        ("grammar", 'start: ""\n'),
        ("grammar", JSON_GBNF),
        ("regex", "[0-9]{3}"),
        ("regex", "abc(d|e)+"),
        ("json", {"type": "object", "properties": {"a": {"type": "string"}}}),
        ("choice", ["yes", "no"]),
    ]:
        check(to_grammar(kind, value), tok)
    for kind, value in [("grammar", 'start: a\na: "x" a\n'), ("regex", "abc[^\\x00-\\U0010FFFF]")]:
        with pytest.raises(Refused, match="admits no text"):
            check(to_grammar(kind, value), tok)


def test_the_caps_count_rules_and_patterns():
    """Lark and GBNF definitions (rules and terminals) are counted; patternProperties of every
    object of a schema are."""
    text = 'root ::= r0\nr0 ::= "a" r1 | "b"\nstart: a\n  | b\nA.2: "x"\n?x : y\nname[lazy]: /a/\n'
    assert rules.grammar_rules(text) == 6
    schema = {
        "patternProperties": {"a": {}, "b": {"patternProperties": {"c": {}}}},
        "items": [{"patternProperties": {"d": {}}}],
    }
    assert rules.schema_patterns(schema) == 4
    limits = rules.GrammarLimits(max_rules=4, max_patterns=3, timeout_s=1.0)
    assert "--grammar-max-rules" in (rules.grammar_text_error("g", text, limits) or "")
    assert "--grammar-max-patterns" in (rules.schema_error("s", schema, 10, limits) or "")
    assert rules.schema_error("s", schema, rules.M.MAX_GRAMMAR_CHARS + 1, limits).startswith("s is 65537 characters")


def test_a_submitted_grammar_is_measured_again():
    """The GPU process's check of a serialized grammar (a Lark text or a JSON envelope)."""
    limits = rules.GrammarLimits(max_rules=3, max_patterns=2, timeout_s=1.0)
    lark = llguidance.grammar_from("grammar", 'root ::= a\na ::= b\nb ::= c\nc ::= "x"\n')
    schema = llguidance.LLMatcher.grammar_from_json_schema({"patternProperties": {"a": {}, "b": {}, "c": {}}})
    assert "--grammar-max-rules" in (rules.compiled_grammar_error(lark, limits) or "")
    assert "--grammar-max-patterns" in (rules.compiled_grammar_error(schema, limits) or "")
    small = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    assert rules.compiled_grammar_error(small, limits) is None
    assert rules.compiled_grammar_error(llguidance.LLMatcher.grammar_from_regex("a+"), limits) is None
