"""A structured-output constraint turned into llguidance's serialized grammar and checked against
the model's vocabulary: the work a worker's grammar process does (`grammar_pool.py`), under the
deadline it is killed at. Pure functions of the constraint; no aiohttp, no event loop.

`to_grammar` converts (JSON schema, regex, choice, Lark or GBNF); `check` compiles the result into
a matcher, as the GPU process will, and refuses a grammar llguidance cannot compile (naming the
construct) or one that admits no text at all: a matcher whose first mask allows nothing but EOS
before the grammar is complete (an empty regex), after any forced tokens, or a Lark grammar whose
`start` never finishes (`lark_emptiness.py`). A refusal is `Refused(code, message)`, the message
written to follow the field's name (`"<param> is not valid JSON: ..."`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORCED_STEPS = 64  # forced tokens followed from the start before the first free choice


class Refused(Exception):
    """The constraint cannot be served: `code` (the API error code) and a message that follows
    the field's name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def to_grammar(kind: str, value: Any, whitespace: str | None = None, closed: bool = False) -> str:
    """llguidance's serialized grammar for a constraint of `kind` (json | regex | choice |
    grammar), not yet checked: `whitespace` is a JSON whitespace pattern (None: one-line JSON),
    `closed` closes every object schema that does not say `additionalProperties`."""
    import llguidance

    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise Refused("invalid_value", f"is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise Refused("invalid_value", "must be a JSON schema (an object).")
        if closed and isinstance(value, dict):
            value = closed_objects(value)
        options: dict[str, Any] = dict(JSON_OPTIONS)
        if whitespace is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": whitespace}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise Refused("invalid_value", f"is not a usable JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.grammar_from("choice", value)
    try:  # "grammar": Lark as llguidance reads it, or GBNF / EBNF (converted)
        return llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        raise Refused("invalid_value", f"is not a grammar ringserve can read (Lark or GBNF): {exc}") from None


def closed_objects(schema: dict) -> dict:
    """`schema` with `additionalProperties: false` on every object schema that lists properties
    and says nothing of others (vLLM's `disable_additional_properties`)."""
    schema = copy.deepcopy(schema)
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, dict):
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for key, sub in node.items():
                if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
                    if isinstance(sub, dict):
                        stack += sub.values()
                elif isinstance(sub, (dict, list)) and key not in ("enum", "const", "examples", "default"):
                    stack.append(sub)
    return schema


def check(grammar: str, tokenizer) -> None:
    """Refuse `grammar` unless llguidance compiles it for `tokenizer` (an `LLTokenizer`) and it
    admits some text."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise Refused("unsupported_value", f"cannot be enforced: {matcher.get_error().strip()}")
    stuck = _dead_start(matcher, tokenizer.eos_token)
    if stuck is not None:
        raise Refused("unsupported_value", f"admits no text: {stuck}")
    lark = _lark_text(grammar)
    if lark is not None:
        from ringserve.api.lark_emptiness import unproductive

        never = unproductive(lark)
        if never:
            names = ", ".join(never[:8]) + (" ..." if len(never) > 8 else "")
            raise Refused(
                "unsupported_value",
                f"admits no text: no derivation of `start` ever ends (the rules {names} each need one of "
                "them again). Give the recursion an alternative that ends.",
            )


def _dead_start(matcher, eos: int) -> str | None:
    """Why the grammar admits nothing from its first token (None: a token other than EOS is
    allowed, or the grammar is already complete), following forced tokens."""
    import numpy as np

    for _ in range(FORCED_STEPS):
        if matcher.is_accepting():
            return None
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        if matcher.is_error():
            return matcher.get_error().strip().splitlines()[0]
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        other = allowed[allowed != eos]
        if len(other) == 0:
            return "nothing the model could write matches it."
        if len(other) > 1 or not matcher.consume_token(int(other[0])):
            return None  # a free choice: the grammar is not dead at its start
    return None


def _lark_text(grammar: str) -> str | None:
    """The Lark text of a serialized grammar that is one (None for a JSON schema or a regex)."""
    if not grammar.lstrip().startswith("{"):
        return grammar
    try:
        parts = json.loads(grammar).get("grammars") or []
    except (ValueError, AttributeError):
        return None
    if len(parts) == 1 and isinstance(parts[0], dict) and isinstance(parts[0].get("lark_grammar"), str):
        lark = parts[0]["lark_grammar"]
        return lark if parts[0].get("name") != "regex" else None
    return None
