"""Tool calling on /v1/chat/completions, the request side: `tools`, `tool_choice` and
`parallel_tool_calls` validated into a `ToolRequest` (`docs/api.md#tool-calling`).

- `tools`: OpenAI's `{"type": "function", "function": {"name", "description", "parameters",
  "strict"}}` objects, rendered through the chat template (`tools` variable, as transformers
  passes them).
- `tool_choice`: `auto` (the default with tools: the model chooses, and the server's parser,
  `--tool-call-parser`, reads what it wrote), `none` (the tools are not rendered, the answer is
  text), `required` and a named function (`{"type": "function", "function": {"name"}}`): forced
  with a grammar, as vLLM does: a named function's answer is its arguments (a JSON schema, the
  function's `parameters`, its objects closed to keys they do not declare), `required`'s an array
  of `{"name", "parameters"}` (one element unless `parallel_tool_calls`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from ringserve.api.errors import bad_request, quoted
from ringserve.api.grammar_compile import closed_objects
from ringserve.api.structured_output import StructuredSpec
from ringserve.rules import GRAMMAR_TOO_COMPLEX, grammar_size_error

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ANY_OBJECT = {"type": "object"}


class Function(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: Function | None = None


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """Validated tools: `tools` as the template reads them, `choice` auto | required | named
    (`name` set), whether several calls may come at once."""

    tools: tuple[dict, ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> StructuredSpec | None:
        """The grammar `required` or a named function imposes (None for `auto`)."""
        if self.choice not in ("named", "required"):
            return None
        used = [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.name]
        chars = sum(len(msgspec.json.encode(t["function"].get("parameters") or _ANY_OBJECT)) for t in used)
        too_big = grammar_size_error("the forced tools' parameters", chars)
        if too_big is not None:  # NOTE: measured before they are copied and closed below
            raise bad_request(too_big, "tools", code=GRAMMAR_TOO_COMPLEX)
        # NOTE: a function takes the parameters it declares: objects that leave other keys open are
        # closed (`additionalProperties: false`), or a small model fills its call with invented keys.
        params = {t["function"]["name"]: closed_objects(t["function"].get("parameters") or _ANY_OBJECT) for t in used}
        if self.choice == "named" and self.name is not None:
            return StructuredSpec("json", params[self.name], "tool_choice")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
        array: dict = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredSpec("json", array, "tools")


def parse_tools(
    tools: list[Tool] | None, tool_choice, parallel: bool | None, *, function_path: str = ".function"
) -> ToolRequest | None:
    """The request's tools (None: no tools, or `tool_choice: none`), or a 400 naming the field.
    `function_path` is where a tool's function fields sit in the client's body (the Responses API
    writes them on the tool itself: "")."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools; send the functions the model may call.", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools holds at most {MAX_TOOLS} tools, got {len(tools)}.", "tools")
    rendered = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function" or tool.function is None:
            shape = (
                '{"type": "function", "function": {"name": ...}}'
                if function_path
                else '{"type": "function", "name": ...}'
            )
            raise bad_request(
                f"{where}.type {quoted(tool.type)} is not supported; ringserve serves function tools ({shape}).",
                f"{where}.type",
                code="unsupported_value",
            )
        fn = tool.function
        name_param = f"{where}{function_path}.name"
        if not _NAME.match(fn.name):
            raise bad_request(
                f"{name_param} must be 1 to 64 letters, digits, '_', '.' or '-', got {quoted(fn.name)}.", name_param
            )
        if fn.name in names:
            raise bad_request(f"{name_param} {quoted(fn.name)} is used twice.", name_param)
        names.add(fn.name)
        function: dict = {"name": fn.name}
        if fn.description is not None:
            function["description"] = fn.description
        function["parameters"] = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        rendered.append({"type": "function", "function": function})
    choice, name = _choice(tool_choice, names)
    if choice == "none":
        return None
    return ToolRequest(tuple(rendered), choice, name, parallel is not False)


def _choice(tool_choice, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice or "auto", None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in names:
                raise bad_request(f"tool_choice names {quoted(name)}, which is not in tools.", "tool_choice")
            return "named", name
    raise bad_request(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}.',
        "tool_choice",
    )
