"""The issue-32 grammars that cost far more than their size (tests of the caps and deadlines)."""

from __future__ import annotations


def gbnf_chain(rules: int) -> str:
    """The issue's GBNF: `root ::= r0`, then `rI ::= "aI" rI+1 | "b"` (conversion is quadratic)."""
    return "root ::= r0\n" + "".join(f'r{i} ::= "a{i}" r{i + 1} | "b"\n' for i in range(rules)) + f'r{rules} ::= "z"\n'


def lark_chain(rules: int) -> str:
    """A chain of Lark rules; about 2,800 of them overflow llguidance's stack."""
    return "start: a0\n" + "".join(f'a{i}:"x" a{i + 1}|"y"\n' for i in range(rules)) + f'a{rules}:"z"\n'


def pattern_schema(n: int) -> dict:
    """The issue's schema: `^xI[a-z]+$` -> integer, n patternProperties (450: ~10 s to check)."""
    return {"type": "object", "patternProperties": {f"^x{i}[a-z]+$": {"type": "integer"} for i in range(n)}}
