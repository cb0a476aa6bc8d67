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
- on /v1/chat/completions, `tool_choice: "required"` or a named function (`chat/tool_calls.py`).

A request sets at most one of them. Parsing (`structured_spec`, no tokenizer) names what was asked;
`GrammarChecker.grammar` measures it against the caps (`ringserve/rules.py`: its size, a
grammar's rules, a schema's patternProperties; 400 `grammar_too_complex` naming the flag) before
any of it is converted, then has a grammar process (`grammar_pool.py`, `grammar_compile.py`)
build llguidance's serialized grammar and check it against the model's vocabulary within
`--grammar-timeout-s`. So a schema or grammar llguidance cannot compile, or one that admits no
text, is a 400 that names the construct (fail closed: never unconstrained text for a request
that asked for a structure), and nothing of it ever runs on the event loop. JSON is generated on
one line (`, ` and `: ` between items) unless a whitespace pattern is given: a small model let
loose on whitespace can spend its whole answer on newlines. The GPU process compiles the grammar
again into its matchers (`gpu_proc/grammar.py`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from ringserve.api.errors import ApiError, bad_request
from ringserve.api.grammar_child import frame
from ringserve.api.grammar_pool import GrammarPool, Outcome
from ringserve.api.request_trace import note_grammar
from ringserve.api.tokenizer import TextCodec
from ringserve.rules import (
    GRAMMAR_TOO_COMPLEX,
    GrammarLimits,
    choice_error,
    grammar_size_error,
    grammar_text_error,
    grammar_timeout_error,
    schema_error,
)

KNOWN_GRAMMARS = 256  # constraints whose outcome is remembered (agents send the same schema every call)
REFUSAL_TTL_S = 60.0  # how long a deadline passed or a crash is answered from memory


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


def _job(spec: StructuredSpec, limits: GrammarLimits) -> list:
    """What a grammar process converts for `spec` (`grammar_child.py`), once it is measured
    within the caps (`rules.py`: size, rules, patterns, choices), or a 400 naming the cap."""
    value, param = spec.value, spec.param
    if spec.kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{param} must be a JSON schema (an object).", param)
        text = msgspec.json.encode(value).decode()
        problem = schema_error(param, value, len(text), limits)
        job_value: object = text
    elif spec.kind == "choice":
        malformed = choice_error(param, value)
        if malformed is not None:
            raise bad_request(malformed, param)
        problem = grammar_size_error(param, sum(len(c) + 3 for c in value))  # as `"a" | "b"`
        job_value = value
    else:  # regex | grammar: a text
        if not isinstance(value, str):
            raise bad_request(f"{param} must be a string.", param)
        problem = grammar_text_error(param, value, limits)
        job_value = value
    if problem is not None:
        raise bad_request(problem, param, code=GRAMMAR_TOO_COMPLEX)
    return [spec.kind, job_value, spec.whitespace, spec.no_additional_properties]


class GrammarChecker:
    """Turns a worker's constraints into checked grammars: the caps on the event loop (cheap,
    before anything is converted), then conversion and check in a grammar process under the
    deadline (`grammar_pool.py`). Outcomes are remembered by constraint (an agent sends the same
    schema every call): a grammar that compiled and a refusal llguidance gave for good, a deadline
    passed or a compiler crash for `REFUSAL_TTL_S`, so a resend costs no second compile. The caps
    run on every request, remembered or not."""

    def __init__(self, codec: TextCodec, limits: GrammarLimits, procs: int = 1) -> None:
        self.codec = codec
        self.limits = limits
        self.pool = GrammarPool(self._init_frame, procs=procs, timeout_s=limits.timeout_s)
        self._known: OrderedDict[bytes, tuple[float, Outcome]] = OrderedDict()

    async def _init_frame(self) -> bytes:
        codec = self.codec
        text = await asyncio.get_running_loop().run_in_executor(None, codec.tokenizer.to_str)
        return frame({"tokenizer": text, "vocab": codec.vocab_size})

    async def grammar(self, spec: StructuredSpec) -> str:
        """The checked grammar for `spec`, or the ApiError to answer with."""
        job = _job(spec, self.limits)
        key = msgspec.msgpack.encode(job)
        now, started = time.monotonic(), time.time()
        known = self._known.get(key)
        if known is not None and known[0] > now:
            self._known.move_to_end(key)
            outcome = known[1]
            note_grammar(started, remembered=True)
        else:
            outcome = await self.pool.run(job)
            note_grammar(started, remembered=False)
            if outcome.kind == "busy":
                raise ApiError(
                    503,
                    "Every grammar process of this worker is busy with other schemas or grammars; retry shortly.",
                    code="grammar_busy",
                    param=spec.param,
                    retry_after_s=1.0,
                )
            # NOTE: a deadline or a crash may be a loaded machine's as much as the grammar's
            ttl = REFUSAL_TTL_S if outcome.kind in ("timeout", "crashed") else math.inf
            self._known[key] = (now + ttl, outcome)
            while len(self._known) > KNOWN_GRAMMARS:
                self._known.popitem(last=False)
        if outcome.kind == "ok":
            return outcome.grammar
        raise self._refusal(outcome, spec.param)

    def _refusal(self, outcome: Outcome, param: str) -> ApiError:
        if outcome.kind == "refused":
            return bad_request(f"{param} {outcome.message}", param, code=outcome.code)
        if outcome.kind == "crashed":
            message = f"{param} crashed the grammar compiler ({outcome.message}); simplify it."
        else:
            message = grammar_timeout_error(param, self.limits.timeout_s)
        return bad_request(message, param, code=GRAMMAR_TOO_COMPLEX)

    async def close(self) -> None:
        await self.pool.close()
