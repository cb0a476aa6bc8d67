"""What a tokenized generation request may ask of the worker and the GPU, checked before it is
submitted (docs/operations.md#per-request-limits).

- The response's size. Every logprob entry the answer will carry (a token with its alternatives:
  `1 + logprobs` entries, echoed prompt tokens and vLLM's `prompt_logprobs` included, for each of
  the `n` choices of each prompt) is CPU time and memory in this worker, and a request can ask for
  millions: 8,000 prompt ids with `echo`, `logprobs` and `prompt_logprobs` of 20 and `n` 16 is a
  259 MB body that held the event loop (every other stream of the worker) for 6 s. Over
  `max_response_logprobs` it is a 400 that names the count, the limit and the flag.
"""

from __future__ import annotations

from ringserve.api.errors import bad_request


def response_logprobs(
    prompt_lens: list[int],
    max_tokens: list[int],
    n: int,
    logprobs: int | None,
    echo: bool,
    prompt_logprobs: int | None,
) -> int:
    """The logprob entries a response carries at most: per prompt, per choice, `1 + logprobs`
    for each generated (and echoed) token, and `1 + prompt_logprobs` for each prompt token."""
    total = 0
    for length, tokens in zip(prompt_lens, max_tokens):
        if logprobs is not None:
            total += ((length if echo else 0) + tokens) * (1 + logprobs)
        if prompt_logprobs is not None:
            total += length * (1 + prompt_logprobs)
    return total * n


def check_response_size(
    prompt_lens: list[int],
    max_tokens: list[int],
    n: int,
    logprobs: int | None,
    *,
    echo: bool,
    prompt_logprobs: int | None,
    limit: int,
) -> None:
    """400 `response_too_large` when the response would carry more than `limit` logprob entries."""
    count = response_logprobs(prompt_lens, max_tokens, n, logprobs, echo, prompt_logprobs)
    if count <= limit:
        return
    raise bad_request(
        f"This request's response would carry {count:,} logprob entries ({len(prompt_lens)} prompt(s) of "
        f"up to {max(prompt_lens):,} tokens x n={n} x (1 + logprobs {logprobs}) per token"
        f"{', echoed' if echo else ''}{f', + prompt_logprobs {prompt_logprobs}' if prompt_logprobs is not None else ''}"
        f"); the limit is {limit:,} per request (--max-response-logprobs). Lower n, logprobs, prompt_logprobs "
        "or max_tokens, or split the prompts over several requests.",
        "logprobs" if logprobs is not None else "prompt_logprobs",
        code="response_too_large",
    )
