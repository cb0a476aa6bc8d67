"""`POST /v1/completions`: validate, tokenize every prompt, then submit and stream SSE or answer one
JSON body (`request_flow.run`)."""

from __future__ import annotations

from aiohttp import web

from ringserve.api.completions.protocol import CompletionRequest, Prompt, parse_body
from ringserve.api.errors import bad_request
from ringserve.api.generation import Generation
from ringserve.api.logprobs import CompletionLogprobs
from ringserve.api.prompt_limits import encode_prompt, fit_ids, resolve_max_tokens
from ringserve.api.protocol import check_min_tokens
from ringserve.api.request_flow import Job, Output, check_available, read_request, run, tokenizing
from ringserve.api.sampling_tokens import constrain, finish_sampling
from ringserve.api.sse import EventEncoder
from ringserve.api.state import ApiState
from ringserve.rules import vocabulary_error


def _body(request_id: str, model: str, gen: Generation) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(gen.arrival),
        "model": model,
        "choices": gen.choices(),
        "usage": gen.usage(),
        "timing": gen.timing(),
        "request_id": request_id,
    }


def _output(tokens_as_ids: bool) -> Output:
    return Output(encoder=EventEncoder, body=_body, logprob_format=CompletionLogprobs(tokens_as_ids))


OUTPUT = _output(False)
OUTPUT_TOKEN_IDS = _output(True)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    st, req = await read_request(request, parse_body)
    common = req.common
    sampling = finish_sampling(common, st.codec)
    if common.structured is not None:
        sampling = await constrain(st, common.structured, sampling)
    check_available(st)
    prompts = await tokenizing(st, _tokenize_all(st, req))
    limit = st.config.max_tokens_limit
    max_tokens = [resolve_max_tokens(len(ids), req.max_tokens, st.config.context_limit, limit) for ids in prompts]
    check_min_tokens(common, min(max_tokens))
    echo = None
    if req.echo:
        skip = common.output.skip_special_tokens
        echo = [
            p if isinstance(p, str) and common.truncate is None else st.codec.decode(ids, skip)
            for p, ids in zip(req.prompts, prompts)
        ]
    job = Job.of(
        common,
        prompts,
        max_tokens,
        sampling,
        req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
        show_prompt_logprobs=common.prompt_logprobs,
        echo=echo,
        score_only=req.score_only,
    )
    return await run(request, st, job, OUTPUT_TOKEN_IDS if common.output.tokens_as_ids else OUTPUT)


async def _tokenize_all(st: ApiState, req: CompletionRequest) -> list[list[int]]:
    return [await _tokenize(st, req, p) for p in req.prompts]


async def _tokenize(st: ApiState, req: CompletionRequest, prompt: Prompt) -> list[int]:
    """A prompt's ids; a prompt that cannot fit the context is refused before any work on it."""
    limit = st.config.context_limit
    truncate = req.common.truncate
    if isinstance(prompt, str):
        return await encode_prompt(
            st.codec,
            prompt,
            max_tokens=req.max_tokens,
            context_limit=limit,
            executor=st.executor,
            inline_chars=st.tokenize_inline_chars,
            add_special_tokens=req.add_special_tokens,
            truncate=truncate,
        )
    outside = vocabulary_error(prompt, st.codec.vocab_size)
    if outside is not None:
        raise bad_request(outside, "prompt")
    return fit_ids(list(prompt), req.max_tokens, limit, truncate)
