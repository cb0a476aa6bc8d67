"""`POST /v1/embeddings`: validate, tokenize every input, then run each as a prefill that pools its
final hidden states (`--embedding-pooling` last or mean, `gpu_proc/pooling.py`) through the same
admission, fair queue and restarts as a generation (`request_flow.run`): a one-token generation
whose token is never shown, as an echo-scoring completion is. The pooled vector is normalized
(unless `normalize` is false) and sent as floats or base64 float32, as OpenAI encodes them.
"""

from __future__ import annotations

import base64

import numpy as np
from aiohttp import web

from ringserve.api.embeddings.protocol import EmbeddingRequest, Input, parse_body
from ringserve.api.errors import ApiError, bad_request
from ringserve.api.generation import Generation
from ringserve.api.prompt_limits import encode_prompt, fit_ids
from ringserve.api.request_flow import Job, Output, check_available, read_request, run, tokenizing
from ringserve.api.sse import EventEncoder
from ringserve.api.state import ApiState
from ringserve.rules import vocabulary_error
from ringserve.shm.messages import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)  # the one hidden token: the cheapest draw


async def handle_embeddings(request: web.Request) -> web.StreamResponse:
    st, req = await read_request(request, parse_body)
    if req.dimensions is not None and req.dimensions != st.embedding_dims:
        raise bad_request(
            f"dimensions {req.dimensions} is not available: {st.model_name!r} gives embeddings of "
            f"{st.embedding_dims or 'its hidden'} dimensions and is not trained to be cut shorter "
            "(Matryoshka); leave dimensions unset.",
            "dimensions",
            code="unsupported_value",
        )
    check_available(st)
    prompts = await tokenizing(st, _tokenize_all(st, req))
    job = Job(
        prompts=prompts,
        max_tokens=[1] * len(prompts),
        sampling=_GREEDY,
        stop=(),
        n=1,
        logprobs=None,
        stream=False,
        cache_salt=None,
        score_only=True,
        pooling=st.config.embedding_pooling,
        request_id=req.request_id,
    )
    return await run(request, st, job, _output(req))


def _output(req: EmbeddingRequest) -> Output:
    def body(request_id: str, model: str, gen: Generation) -> dict:
        if gen.pools is None:
            raise ApiError(500, "an embedding request's generation pools nothing", code="internal_error")
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(pool.mean(), req.normalize, req.base64)}
            for i, pool in enumerate(gen.pools)
        ]
        usage = {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens}
        return {
            "id": f"embd-{request_id}",
            "object": "list",
            "created": int(gen.arrival),
            "model": model,
            "data": data,
            "usage": usage,
        }

    return Output(encoder=EventEncoder, body=body)  # never streamed: the encoder is not used


def _encode(vector: np.ndarray, normalize: bool, as_base64: bool) -> list[float] | str:
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # torch's F.normalize, as vLLM
    values = vector.astype("<f4")
    return base64.b64encode(values.tobytes()).decode() if as_base64 else values.tolist()


async def _tokenize_all(st: ApiState, req: EmbeddingRequest) -> list[list[int]]:
    return [await _tokenize(st, req, item, i) for i, item in enumerate(req.inputs)]


async def _tokenize(st: ApiState, req: EmbeddingRequest, item: Input, i: int) -> list[int]:
    """An input's ids; one that cannot fit the context is refused before any work on it. The one
    hidden token takes a position, so an input holds at most `context_limit - 1` tokens."""
    param = "input" if len(req.inputs) == 1 else f"input[{i}]"
    limit = st.config.context_limit - 1
    if isinstance(item, str):
        return await encode_prompt(
            st.codec,
            item,
            max_tokens=0,
            context_limit=limit,
            executor=st.executor,
            inline_chars=st.tokenize_inline_chars,
            add_special_tokens=req.add_special_tokens,
            param=param,
            truncate=req.truncate,
        )
    outside = vocabulary_error(item, st.codec.vocab_size)
    if outside is not None:
        raise bad_request(outside, param)
    return fit_ids(list(item), 0, limit, req.truncate, param=param)
