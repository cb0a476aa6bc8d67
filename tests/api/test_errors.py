"""Error statuses of /v1/completions in the OpenAI shape: 400, 401, 404, 413, 429, 503."""

from __future__ import annotations

import pytest

from ringserve.api.fake_gpu import FakeGpu
from ringserve.shm.messages import MAX_STOP_TOKEN_IDS, Rejected

pytestmark = pytest.mark.asyncio


async def _error(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 9000}, "prompt"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"prompt": "x", "presence_penalty": -3}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
        ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
        ({"prompt": "x", "bad_words": [" "]}, "bad_words"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"prompt": "x", "truncation_side": "middle"}, "truncation_side"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "priority": 1}, "priority"),
        ({"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"prompt": "x", "structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        ({"prompt": "x", "guided_json": {"type": "string", "format": "nope"}}, "guided_json"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt[1]"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [10**9]}, "prompt"),
        ({"prompt_token_ids": [2**64]}, "prompt_token_ids"),
        ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"prompt": "x", "top_k": 2**70}, "top_k"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "s" * 1025}, "cache_salt"),
    ],
)
async def test_bad_fields_are_400_naming_the_field(serve, body, param):
    """Wrong types, out-of-range values and unsupported values of known fields name the field."""
    served = await serve()
    err = await _error(await served.client.post("/v1/completions", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert served.fake.submits == []


async def test_deeply_nested_json_is_400(serve):
    """JSON nested thousands deep is a 400, not a 500 from the decoder's recursion limit."""
    served = await serve()
    body = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    err = await _error(await served.client.post("/v1/completions", data=body), 400)
    assert err["code"] == "invalid_json" and "nested" in err["message"]


async def test_bad_json_is_400(serve):
    """A body that is not JSON is a 400."""
    served = await serve()
    err = await _error(await served.client.post("/v1/completions", data=b"{nope"), 400)
    assert err["code"] == "invalid_json"


async def test_context_limit_checked_after_tokenizing(serve, codec):
    """prompt + max_tokens over the context limit is a 400 that says the numbers."""
    served = await serve(context_limit=64, max_tokens_limit=32)
    text = "word " * 20
    n = len(codec.encode(text))
    assert n + 32 > 64 >= n
    err = await _error(await served.client.post("/v1/completions", json={"prompt": text, "max_tokens": 32}), 400)
    assert err["code"] == "context_length_exceeded" and str(n) in err["message"]


async def test_body_too_large_is_413(serve):
    """A body over max_body_bytes is refused with 413 in the OpenAI shape."""
    served = await serve(max_body_bytes=1024)
    err = await _error(await served.client.post("/v1/completions", json={"prompt": "x" * 5000}), 413)
    assert err["code"] == "request_too_large"


async def test_queue_over_limit_is_429_with_retry_after(serve):
    """The GPU process's 429 refusal reaches the client with Retry-After, before any SSE."""
    fake = FakeGpu(
        admit=lambda s: Rejected(
            rid=s.rid, status=429, code="queue_full", message="2.4 s of GPU work queued", retry_after_s=1.3
        )
    )
    served = await serve(fake=fake)
    resp = await served.client.post("/v1/completions", json={"prompt": "x", "stream": True})
    err = await _error(resp, 429)
    assert resp.headers["Retry-After"] == "2" and err["type"] == "rate_limit_error"
    assert resp.headers["Content-Type"].startswith("application/json")
    assert resp.headers["x-request-id"]


@pytest.mark.parametrize("path", ["/v1/completions", "/ready"])
async def test_gpu_not_ready_is_503_with_retry_after(serve, path):
    """While the GPU process is not ready, completions and /ready answer 503 + Retry-After."""
    served = await serve(ready=lambda: False)
    method = served.client.post if path == "/v1/completions" else served.client.get
    resp = await method(path, json={"prompt": "x"})
    err = await _error(resp, 503)
    assert err["code"] == "gpu_not_ready" and int(resp.headers["Retry-After"]) >= 1


async def test_draining_is_503(serve):
    """A draining worker refuses new requests with 503."""
    served = await serve()
    served.state.draining = True
    err = await _error(await served.client.post("/v1/completions", json={"prompt": "x"}), 503)
    assert err["code"] == "server_draining"


async def test_unknown_model_is_404(serve):
    """Naming another model is refused like OpenAI does."""
    served = await serve()
    err = await _error(await served.client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


async def test_rejections_are_counted(serve):
    """Requests and refusals by status show up in the worker's stats."""
    served = await serve(ready=lambda: False)
    await served.client.post("/v1/completions", data=b"{")
    await served.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    stats = served.state.stats
    assert (stats.get("requests_total"), stats.get("requests_rejected_400"), stats.get("requests_rejected_other")) == (
        2,
        1,
        1,
    )


async def test_invalid_utf8_is_400(serve):
    """A body whose strings are not UTF-8 is a 400, not a server error."""
    served = await serve()
    resp = await served.client.post(
        "/v1/completions",
        data=b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}',
        headers={"Content-Type": "application/json"},
    )
    err = await _error(resp, 400)
    assert err["code"] == "invalid_json" and "UTF-8" in err["message"]
