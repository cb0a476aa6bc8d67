"""Structured output, the API worker's side (`docs/design.md#structured-output`): every way a
client asks for constrained text, turned into one llguidance grammar, checked before submitting.

The ways, all honoured the same way (none is ever ignored):
- OpenAI's `response_format`: `{"type": "text"}` (unconstrained), `{"type": "json_object"}` (any
  JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict", ...}}`
  (`strict: true` closes every object the schema leaves open, as OpenAI's strict mode requires);
- vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice` (a list of strings),
  `grammar` (Lark or GBNF/EBNF), `json_object`; with `whitespace_pattern`,
  `disable_any_whitespace`, `disable_additional_properties`;
- vLLM's older fields: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern` (`guided_decoding_backend` names an engine; llguidance always serves);
- on /v1/chat/completions, `tool_choice: "required"` or a named function (`tool_calls.py`).

A request sets at most one of them. Parsing (`structured_spec`, no tokenizer) names what was asked;
`compile_spec` builds llguidance's serialized grammar and validates it against the model's
vocabulary (in the worker's thread pool, cached by grammar text), so a schema or grammar
llguidance cannot compile is a 400 that names the construct (fail closed: never unconstrained
text for a request that asked for a structure). JSON is generated on one line (`, ` and `: `
between items) unless a whitespace pattern is given: a small model let loose on whitespace can
spend its whole answer on newlines. The GPU process compiles the grammar again into its matchers
(`gpu_proc/grammar.py`).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from ringserve.api.errors import bad_request
from ringserve.api.tokenizer import TextCodec

VALIDATED_GRAMMARS = 256  # grammar texts known to compile (agents send the same schema every call)
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` object (unknown keys are ignored and named, as everywhere)."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What a request asked to be constrained to: `kind` (json | regex | choice | grammar), the
    value, and the field it came from (the error's `param`)."""

    kind: str
    value: Any
    param: str
    whitespace: str | None = None  # a JSON whitespace pattern; None: one-line JSON
    no_additional_properties: bool = False


def structured_spec(body) -> StructuredSpec | None:
    """The constraint a request body asks for (None: unconstrained), or a 400 naming the field.
    `body` has the fields above (`protocol.SamplingBody` declares them for both routes)."""
    found: list[StructuredSpec] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append(spec)
    so = body.structured_outputs
    if so is not None:
        found += _structured_outputs(so)
    ws = body.guided_whitespace_pattern
    legacy = (
        ("guided_json", "json", body.guided_json),
        ("guided_regex", "regex", body.guided_regex),
        ("guided_choice", "choice", body.guided_choice),
        ("guided_grammar", "grammar", body.guided_grammar),
    )
    found += [StructuredSpec(kind, value, param, ws) for param, kind, value in legacy if value is not None]
    if ws is not None and not any(s.param == "guided_json" for s in found):
        raise bad_request(
            "guided_whitespace_pattern applies to guided_json only; set guided_json too.", "guided_whitespace_pattern"
        )
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise bad_request(f"set one structured-output constraint, not several ({names}).", found[1].param)
    return found[0] if found else None


def _response_format(rf: dict) -> StructuredSpec | None:
    js = rf.get("json_schema")
    if rf.get("type") == "json_schema" and (not isinstance(js, dict) or not isinstance(js.get("name", ""), str)):
        raise bad_request(
            'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.',
            "response_format.json_schema",
        )
    return format_spec(rf.get("type"), js, "response_format", "response_format.json_schema.schema")


def format_spec(kind, json_schema: dict | None, param: str, schema_param: str) -> StructuredSpec | None:
    """OpenAI's output format `kind` (text, json_object, json_schema with its `{"schema",
    "strict", ...}` object) as a constraint; `param` and `schema_param` are where the format and
    its schema sit in the body (chat's `response_format`, the Responses API's `text.format`)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json", {"type": "object"}, param)
    if kind == "json_schema" and json_schema is not None:
        schema = json_schema.get("schema", {"type": "object"})  # OpenAI: a missing schema is any object
        # NOTE: OpenAI's strict mode requires every object to be closed; so it is generated here
        strict = json_schema.get("strict") is True
        return StructuredSpec("json", schema, schema_param, no_additional_properties=strict)
    raise bad_request(
        f"{param} type {json.dumps(kind)} is not supported; use text, json_object or json_schema.",
        f"{param}.type",
        code="unsupported_value",
    )


def _structured_outputs(so: StructuredOutputs) -> list[StructuredSpec]:
    if so.structural_tag is not None:
        raise bad_request(
            "structured_outputs.structural_tag is not supported; use json, regex, choice, grammar or json_object.",
            "structured_outputs.structural_tag",
            code="unsupported_value",
        )
    ws = so.whitespace_pattern
    strict_props = bool(so.disable_additional_properties)
    kinds = (
        ("json", so.json),
        ("regex", so.regex),
        ("choice", so.choice),
        ("grammar", so.grammar),
        ("json", {"type": "object"} if so.json_object else None),
    )
    params = ("json", "regex", "choice", "grammar", "json_object")
    out = [
        StructuredSpec(kind, value, f"structured_outputs.{param}", ws, strict_props)
        for (kind, value), param in zip(kinds, params)
        if value is not None
    ]
    if not out and (ws is not None or so.disable_any_whitespace or strict_props):
        raise bad_request(
            "structured_outputs sets options but no constraint; add json, regex, choice, grammar or json_object.",
            "structured_outputs",
        )
    return out


def to_grammar(spec: StructuredSpec) -> str:
    """llguidance's serialized grammar for `spec` (not yet validated), or a 400."""
    import llguidance

    value, param = spec.value, spec.param
    if spec.kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{param} must be a JSON schema (an object).", param)
        if spec.no_additional_properties and isinstance(value, dict):
            value = closed_objects(value)
        options = dict(JSON_OPTIONS)
        if spec.whitespace is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise bad_request(f"{param} is not a usable JSON schema: {exc}", param) from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if spec.kind == "choice":
        if not value or len(value) > MAX_CHOICES or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must hold 1 to {MAX_CHOICES} non-empty strings.", param)
        return llguidance.grammar_from("choice", value)
    try:  # "grammar": Lark as llguidance reads it, or GBNF / EBNF (converted)
        return llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        raise bad_request(f"{param} is not a grammar ringserve can read (Lark or GBNF): {exc}", param) from None


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


class GrammarChecker:
    """Validates grammars against the model's vocabulary (llguidance's tokenizer, built from the
    worker's tokenizer on first use), off the event loop, remembering those that compiled."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self._tokenizer = None
        self._valid: OrderedDict[str, None] = OrderedDict()

    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            backend = self.codec.tokenizer
            self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.codec.vocab_size)
        return self._tokenizer

    def error(self, grammar: str) -> str | None:
        """Why llguidance cannot compile `grammar` for this model (None: it can)."""
        if grammar in self._valid:
            self._valid.move_to_end(grammar)
            return None
        import llguidance

        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())
        if problem:
            return problem.strip()
        self._valid[grammar] = None
        while len(self._valid) > VALIDATED_GRAMMARS:
            self._valid.popitem(last=False)
        return None


async def compile_spec(spec: StructuredSpec, checker: GrammarChecker, executor=None) -> str:
    """The grammar to submit for `spec`, validated; a 400 naming the construct llguidance refuses."""
    grammar = to_grammar(spec)
    if grammar in checker._valid:
        return grammar
    problem = await asyncio.get_running_loop().run_in_executor(executor, checker.error, grammar)
    if problem:
        raise bad_request(
            f"{spec.param} cannot be enforced: {problem}",
            spec.param,
            code="unsupported_value",
        )
    return grammar
