"""Reasoning settings (`api/chat/reasoning.py`): chat's `reasoning_effort` and the Responses API's
`reasoning` are accepted for every valid value, reach a template that reads them, are named as
ignored where the template does not; /tokenize renders tools; a refused field names its default,
a refused tool the shape of its route."""

from __future__ import annotations

import pytest

from ringserve.api.chat.template import ChatTemplate
from tests.api.conftest import TOOLS_TEMPLATE

pytestmark = pytest.mark.asyncio

REASONING_TEMPLATE = (
    "{%- for message in messages %}{{- bos_token + message['role'] + '\\n' + message['content'] + eos_token }}"
    "{%- endfor %}"
    "{%- if reasoning_effort is defined %}{{- 'effort=' + reasoning_effort }}{%- endif %}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- ' no-thinking' }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- bos_token + 'assistant\\n' }}{%- endif %}"
)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def reasoning_template(tmp_path, tiny_model_dir, codec) -> ChatTemplate:
    path = tmp_path / "reasoning.jinja"
    path.write_text(REASONING_TEMPLATE)
    return ChatTemplate.load(tiny_model_dir, codec, path)


def _prompt(served, codec) -> str:
    return codec.decode(served.fake.submits[-1].prompt_ids, False)


async def test_an_effort_reaches_a_template_that_reads_it(serve, codec, reasoning_template):
    served = await serve(app_kw={"chat_template": reasoning_template})
    for effort, want in (("high", "effort=high"), ("none", "effort=none no-thinking")):
        resp = await served.client.post(
            "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "reasoning_effort": effort}
        )
        assert resp.status == 200, await resp.text()
        assert "x-ringserve-ignored-fields" not in resp.headers
        assert want in _prompt(served, codec)
    # the client's own template variable wins over the one the effort sets
    body = {
        "messages": HI,
        "max_tokens": 1,
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": True},
    }
    assert (await served.client.post("/v1/chat/completions", json=body)).status == 200
    assert "effort=none" in _prompt(served, codec) and "no-thinking" not in _prompt(served, codec)
    resp = await served.client.post("/v1/responses", json={"input": "hi", "reasoning": {"effort": "low"}})
    assert resp.status == 200 and "effort=low" in _prompt(served, codec)
    assert (await resp.json())["reasoning"] == {"effort": "low", "summary": None}


async def test_an_effort_the_template_does_not_read_is_accepted_and_named(serve):
    served = await serve()  # the tiny model's template reads neither variable
    resp = await served.client.post(
        "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "reasoning_effort": "medium"}
    )
    assert resp.status == 200 and resp.headers["x-ringserve-ignored-fields"] == "reasoning_effort"
    # what Codex CLI sends on every request
    body = {"input": "hi", "reasoning": {"effort": "medium", "summary": "auto"}, "future_field": 1}
    resp = await served.client.post("/v1/responses", json=body)
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-ringserve-ignored-fields"] == "future_field, reasoning.effort, reasoning.summary"
    assert (await resp.json())["reasoning"] == {"effort": "medium", "summary": "auto"}


async def test_an_invalid_effort_is_a_400_naming_the_values(serve):
    served = await serve()
    resp = await served.client.post("/v1/chat/completions", json={"messages": HI, "reasoning_effort": "max"})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "reasoning_effort"
    assert "none, minimal, low, medium, high, xhigh" in error["message"]


async def test_a_refused_field_names_its_default(serve):
    served = await serve()
    resp = await served.client.post("/v1/chat/completions", json={"messages": HI, "echo": True})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "echo" and "leave it unset or send false" in error["message"]
    resp = await served.client.post("/v1/completions", json={"prompt": "a", "best_of": 3})
    assert "send null or n" in (await resp.json())["error"]["message"]


async def test_hosted_tools_on_responses_are_left_out_and_namespaces_flattened(serve, tools_template, codec):
    """What Codex sends: a `web_search` tool (hosted: ringserve cannot run it) is left out and named
    as ignored, a `namespace` of function tools is served as those functions; on chat, where there
    are no hosted tools, another type is a 400 showing chat's tool shape."""
    served = await serve(app_kw={"chat_template": tools_template})
    fn = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}
    tools = [
        {"type": "web_search", "external_web_access": False},
        {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [fn]},
    ]
    resp = await served.client.post("/v1/responses", json={"input": "hi", "tools": tools, "max_output_tokens": 2})
    assert resp.status == 200, await resp.text()
    ignored = {f.strip() for f in resp.headers["x-ringserve-ignored-fields"].split(",")}
    assert {"tools[0]", "tools[0].external_web_access"} <= ignored
    prompt = codec.decode(served.fake.submits[-1].prompt_ids, False)
    assert '"spawn_agent"' in prompt and "web_search" not in prompt
    resp = await served.client.post("/v1/chat/completions", json={"messages": HI, "tools": [{"type": "web_search"}]})
    assert '{"type": "function", "function": {"name": ...}}' in (await resp.json())["error"]["message"]


async def test_tokenize_renders_tools_as_the_chat_route_does(serve, tmp_path, tiny_model_dir, codec):
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    served = await serve(app_kw={"chat_template": ChatTemplate.load(tiny_model_dir, codec, path)})
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    resp = await served.client.post("/tokenize", json={"messages": HI, "tools": tools})
    assert resp.status == 200, await resp.text()
    tokens = (await resp.json())["tokens"]
    chat = await served.client.post("/v1/chat/completions", json={"messages": HI, "tools": tools, "max_tokens": 1})
    assert chat.status == 200 and served.fake.submits[-1].prompt_ids == tokens
    assert '"weather"' in codec.decode(tokens, False)
    bad = await served.client.post("/tokenize", json={"messages": HI, "tools": [{"type": "web_search"}]})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "tools[0].type"


async def test_tokenize_refuses_tools_a_template_cannot_render(serve):
    served = await serve()
    tools = [{"type": "function", "function": {"name": "f"}}]
    resp = await served.client.post("/tokenize", json={"messages": HI, "tools": tools})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tools"
