"""API test fixtures: the tiny model's tokenizer, an app wired to the in-process fake GPU, and
helpers to read SSE streams."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ringserve.api.app import init_app
from ringserve.api.auth import Authenticator
from ringserve.api.chat_template import ChatTemplate
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
        app = init_app(
            Config(**config),
            GpuClient(fake, ready=ready),
            codec,
            status(fake, ready),
            model_name=MODEL,
            auth=Authenticator(keys),
            **{"chat_template": chat_template, **(app_kw or {})},
        )
        client = await aiohttp_client(app)
        return Served(client, fake, app[STATE])

    return _serve
