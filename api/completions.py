"""`POST /v1/completions`: validate, tokenize, then submit and stream SSE or answer one JSON body
(`request_flow.run`)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ringserve.api.errors import bad_request
from ringserve.api.generation import Generation
from ringserve.api.protocol import CompletionRequest, check_model, parse_body
from ringserve.api.prompt_limits import check_fits, encode_prompt
from ringserve.api.request_flow import Job, Output, check_available, run
from ringserve.api.sse import EventEncoder
from ringserve.api.state import STATE, ApiState
from ringserve.rules import vocabulary_error


def _body(request_id: str, model: str, gen: Generation) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(gen.arrival),
            "model": model, "choices": gen.choices(), "usage": gen.usage(),
            "timing": gen.timing(), "request_id": request_id}


OUTPUT = Output(encoder=lambda request_id, model, created, timing: EventEncoder(request_id, model, created),
                body=_body)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    st.stats.add("requests_total")
    req = parse_body(await request.read(), max_tokens_limit=st.config.max_tokens_limit)
    check_model(req.model, st.model_name)
    check_available(st)
    try:
        prompt_ids = await _tokenize(st, req)
    except asyncio.CancelledError:
        st.stats.add("disconnects")  # the client left while its prompt was tokenized
        raise
    return await run(request, st, Job(prompt_ids=prompt_ids, max_tokens=req.max_tokens,
                                      sampling=req.sampling, stop=req.stop, n=req.n,
                                      logprobs=req.logprobs, stream=req.stream,
                                      cache_salt=req.cache_salt), OUTPUT)


async def _tokenize(st: ApiState, req: CompletionRequest) -> list[int]:
    """The prompt's ids; a prompt that cannot fit the context is refused before any work on it."""
    limit = st.config.context_limit
    if req.prompt_ids is not None:
        check_fits(len(req.prompt_ids), req.max_tokens, limit)
        outside = vocabulary_error(req.prompt_ids, st.codec.vocab_size)
        if outside is not None:
            raise bad_request(outside, "prompt")
        return list(req.prompt_ids)
    return await encode_prompt(st.codec, req.prompt_text, max_tokens=req.max_tokens,
                               context_limit=limit, executor=st.executor,
                               inline_chars=st.tokenize_inline_chars)
