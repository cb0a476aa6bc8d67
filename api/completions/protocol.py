"""`POST /v1/completions` bodies: decoded with msgspec, validated into a frozen `CompletionRequest`.

The sampling fields are `protocol.SamplingBody`'s. On top: the prompt (a string, a list of token
ids, or a batch: a list of strings or of token-id lists, or `prompt_token_ids`), `max_tokens`
(absent: 16, OpenAI's default; null: up to the context; 0 only with `echo`, which then scores the
prompt without generating), `logprobs`, `echo`, `add_special_tokens`; `suffix`, `best_of` and
`prompt_embeds` at their neutral values only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ringserve.api.body import decode_body
from ringserve.api.errors import bad_request
from ringserve.api.protocol import (
    MAX_LOGPROBS,
    Prompt,
    SamplingBody,
    SamplingFields,
    check_max_tokens,
    check_neutral,
    parse_sampling,
    prompt_batch,
    token_ids,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's, when max_tokens is absent
MAX_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS default


class _Body(SamplingBody):
    """The /v1/completions wire shape; types only."""

    prompt: str | list | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None | msgspec.UnsetType = msgspec.UNSET  # null differs from absent
    logprobs: int | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True
    # accepted at their neutral values only
    suffix: str | None = None
    best_of: int | None = None
    prompt_embeds: str | list | None = None


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated completion request: one or more prompts (text, or token ids), each answered
    with `n` choices. `max_tokens` None: up to the context; `score_only`: `max_tokens` was 0 with
    `echo` (one token is generated and not shown, as vLLM does)."""

    prompts: tuple[Prompt, ...]
    model: str | None
    max_tokens: int | None
    score_only: bool
    logprobs: int | None
    echo: bool
    prompt_logprobs: int | None  # alternatives per prompt token the GPU computes (None: not scored)
    add_special_tokens: bool
    common: SamplingFields


_decoder = msgspec.json.Decoder(_Body)


def parse_body(
    raw: bytes, *, max_tokens_limit: int, on_ignored: Callable[[tuple[str, ...]], None] = lambda names: None
) -> CompletionRequest:
    """Decode and validate a request body, raising `ApiError(400)` naming the offending field;
    `on_ignored(names)` hears of unknown fields first, so even that 400 can name them."""
    body, ignored = decode_body(_decoder, raw)
    on_ignored(ignored)
    echo = bool(body.echo)
    n = body.n or 1
    check_neutral(
        {
            "suffix": (body.suffix in (None, ""), '""'),
            "best_of": (body.best_of in (None, n), "null or n"),
            "prompt_embeds": (not body.prompt_embeds, "null"),
        }
    )
    prompts = _prompts(body)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is msgspec.UNSET else body.max_tokens
    score_only = max_tokens == 0 and echo
    if max_tokens is not None and not score_only:
        check_max_tokens(max_tokens, max_tokens_limit, "max_tokens")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}.", "logprobs")
    common = parse_sampling(body)
    scored = common.prompt_logprobs
    if scored is None and echo and body.logprobs is not None:
        scored = body.logprobs  # the echoed prompt's logprobs (vLLM: prompt_logprobs = logprobs)
    return CompletionRequest(
        prompts=prompts,
        model=body.model,
        max_tokens=1 if score_only else max_tokens,
        score_only=score_only,
        logprobs=body.logprobs,
        echo=echo,
        prompt_logprobs=scored,
        add_special_tokens=body.add_special_tokens is not False,
        common=common,
    )


def _prompts(body: _Body) -> tuple[Prompt, ...]:
    given = [name for name in ("prompt", "prompt_token_ids") if getattr(body, name) is not None]
    if len(given) != 1:
        raise bad_request(
            "Send exactly one of 'prompt' and 'prompt_token_ids'.",
            "prompt",
            code="missing_prompt" if not given else "invalid_value",
        )
    if body.prompt_token_ids is not None:
        return (token_ids(body.prompt_token_ids, "prompt_token_ids"),)
    assert body.prompt is not None
    # A batch (OpenAI's shapes): each prompt becomes its own choices.
    return prompt_batch(body.prompt, "prompt", MAX_PROMPTS)
