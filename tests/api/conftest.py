"""API test fixtures: the tiny model's tokenizer, an app wired to the in-process fake GPU, and
helpers to read SSE streams."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ringserve.api.app import init_app
from ringserve.api.auth import Authenticator
from ringserve.api.chat.template import ChatTemplate
from ringserve.api.fake_gpu import FakeGpu, FakeStatus
from ringserve.api.gpu_client import GpuClient
from ringserve.api.state import STATE, ApiState
from ringserve.api.tokenizer import TextCodec
from ringserve.config import Config
from tests.helpers.fake_api import MODEL


@pytest.fixture(scope="session")
def codec(tiny_model_dir) -> TextCodec:
    return TextCodec.from_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def chat_template(tiny_model_dir, codec) -> ChatTemplate:
    """The tiny model's chat template (every test app gets it unless app_kw says otherwise)."""
    return ChatTemplate.load(tiny_model_dir, codec)


# a tools-aware template for the tiny model's tokenizer (its own has no tools)
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- bos_token + 'tools\\n' + (tools | tojson) + eos_token + '\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- bos_token + message['role'] + '\\n' + message['content'] }}"
    "{%- if message.tool_calls is defined %}{{- message.tool_calls | tojson }}{%- endif %}"
    "{{- eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- bos_token + 'assistant\\n' }}{%- endif %}"
)


@pytest.fixture
def tools_template(tmp_path, tiny_model_dir, codec) -> ChatTemplate:
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    return ChatTemplate.load(tiny_model_dir, codec, path)


@dataclass
class Served:
    client: object  # aiohttp TestClient
    fake: FakeGpu
    state: ApiState


@pytest.fixture
def serve(aiohttp_client, codec, chat_template) -> Callable:
    """`await serve(fake=..., keys=..., ready=..., app_kw=..., status=..., **config)` -> Served, on a
    fresh app (`status(fake, ready)` builds its GpuStatus: a FakeStatus by default)."""

    async def _serve(
        fake: FakeGpu | None = None,
        keys: frozenset[str] | None = None,
        ready: Callable[[], bool] = lambda: True,
        app_kw: dict | None = None,
        status: Callable[[FakeGpu, Callable[[], bool]], FakeStatus] = FakeStatus,
        **config,
    ) -> Served:
        fake = fake or FakeGpu()
        gpu_status = status(fake, ready)
        app = init_app(
            Config(**config),
            GpuClient(fake, ready=ready, quarantined=lambda: fake.quarantined),
            codec,
            gpu_status,
            model_name=MODEL,
            auth=Authenticator(keys),
            **{"chat_template": chat_template, **(app_kw or {})},
        )
        client = await aiohttp_client(app)
        return Served(client, fake, app[STATE])

    return _serve
