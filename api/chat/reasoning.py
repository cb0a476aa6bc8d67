"""Reasoning settings: chat's `reasoning_effort` and the Responses API's `reasoning` object.

A valid value is never a 400 (Codex CLI and openai-agents always send one). It reaches the model
the way reasoning templates read it: as the template variable `reasoning_effort` (gpt-oss-style
templates) and as `enable_thinking` (Qwen3-style templates: false only for effort "none"); a
variable the client sets itself in `chat_template_kwargs` wins. A template that reads neither gets
nothing, and the field is named in `x-ringserve-ignored-fields`, as an unknown field is.
"""

from __future__ import annotations

from ringserve.api.chat.template import ChatTemplate
from ringserve.api.errors import bad_request, quoted

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")
_VARIABLES = ("reasoning_effort", "enable_thinking")


def check_effort(value: str | None, param: str) -> str | None:
    if value is not None and value not in EFFORTS:
        raise bad_request(f"{param} must be one of {', '.join(EFFORTS)}, got {quoted(str(value))}.", param)
    return value


def template_variables(template: ChatTemplate, effort: str | None) -> dict:
    """The variables `effort` sets for `template` (empty: the template reads none of them)."""
    if effort is None:
        return {}
    values = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    return {name: values[name] for name in _VARIABLES if template.reads(name)}
