"""`POST /v1/embeddings` bodies (OpenAI's and vLLM's shape): decoded with msgspec, validated into a
frozen `EmbeddingRequest`.

`input` is a string, a list of token ids, or a batch of either (at most `MAX_INPUTS`, OpenAI's
limit); `encoding_format` float or base64; `dimensions` only the model's own (it has no Matryoshka
training: a cut vector would be a poor embedding, so it is refused rather than cut); vLLM's
`truncate_prompt_tokens`, `add_special_tokens` and `normalize`; `user` is accepted and unused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ringserve.api.body import decode_body
from ringserve.api.errors import bad_request
from ringserve.api.protocol import Prompt, check_neutral, prompt_batch

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
ENCODING_FORMATS = ("float", "base64")

Input = Prompt


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    """The /v1/embeddings wire shape; types only."""

    input: str | list | None = None
    model: str | None = None
    encoding_format: str | None = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = True
    normalize: bool | None = True
    request_id: str | None = None
    priority: int | None = 0  # accepted at its neutral value only


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    inputs: tuple[Input, ...]
    model: str | None
    base64: bool
    dimensions: int | None
    truncate: tuple[int, str] | None  # (tokens to keep, -1: the context; always from the left)
    add_special_tokens: bool
    normalize: bool
    request_id: str | None


_decoder = msgspec.json.Decoder(_Body)


def parse_body(
    raw: bytes, *, max_tokens_limit: int = 0, on_ignored: Callable[[tuple[str, ...]], None] = lambda names: None
) -> EmbeddingRequest:
    """Decode and validate a request body, raising `ApiError(400)` naming the offending field;
    `on_ignored(names)` hears of unknown fields first. (`max_tokens_limit`: the routes' common
    signature; an embedding generates nothing.)"""
    body, ignored = decode_body(_decoder, raw)
    on_ignored(ignored)
    check_neutral({"priority": (not body.priority, "0")})
    fmt = body.encoding_format or "float"
    if fmt not in ENCODING_FORMATS:
        raise bad_request(
            f"encoding_format must be {' or '.join(map(repr, ENCODING_FORMATS))}, got {fmt!r}.", "encoding_format"
        )
    if body.dimensions is not None and body.dimensions < 1:
        raise bad_request(f"dimensions must be a positive integer, got {body.dimensions}.", "dimensions")
    keep = body.truncate_prompt_tokens
    if keep is not None and keep < -1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the context) or >= 0, got {keep}.", "truncate_prompt_tokens"
        )
    return EmbeddingRequest(
        inputs=_inputs(body.input),
        model=body.model,
        base64=fmt == "base64",
        dimensions=body.dimensions,
        truncate=None if keep is None else (keep, "left"),  # vLLM keeps the last tokens
        add_special_tokens=body.add_special_tokens is not False,
        normalize=body.normalize is not False,
        request_id=body.request_id,
    )


def _inputs(given: str | list | None) -> tuple[Input, ...]:
    if given is None:
        raise bad_request(
            "input is required: a string, a list of token ids, or a list of either.", "input", "missing_input"
        )
    return prompt_batch(given, "input", MAX_INPUTS)
