"""A prompt's size is checked before work is spent on it, and tokenizing never holds the event loop
(docs/design.md#limits-and-timeouts).

Bytes first: every token stands for at most `TextCodec.max_token_bytes` bytes of the prompt, so a
prompt of B UTF-8 bytes is at least ceil(B / max_token_bytes) tokens. When that lower bound plus
max_tokens is already over the context, the prompt is refused without tokenizing it: a 4 MB
prompt costs a length check, not seconds of CPU. (The codec derives the bound only for tokenizers
that never drop or shrink text; for others this check passes and the exact count decides.)

Then the tokens: a long prompt is tokenized in a worker thread with `encode_batch`, which releases
the GIL while the Rust tokenizer runs (plain `encode` holds it for the whole call, so a thread
would not help), so the loop keeps streaming everyone else's tokens and beating the heartbeat.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from ringserve.api.errors import bad_request
from ringserve.api.tokenizer import TextCodec
from ringserve.rules import CONTEXT_LENGTH_EXCEEDED, context_error


def utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def min_prompt_tokens(codec: TextCodec, text: str) -> int:
    """A sound lower bound on the tokens `text` encodes to (0 when the codec cannot bound it)."""
    per_token = codec.max_token_bytes
    if per_token is None:
        return 0
    return -(-utf8_length(text) // per_token)


def check_fits(
    prompt_tokens: int, max_tokens: int | None, context_limit: int, *, at_least: bool = False, param: str = "prompt"
) -> None:
    """400 `context_length_exceeded` when the prompt and max_tokens (None: an answer of one token
    at least) cannot fit the context."""
    message = context_error(prompt_tokens, max_tokens, context_limit, at_least=at_least)
    if message is not None:
        raise bad_request(message, param, code=CONTEXT_LENGTH_EXCEEDED)


async def encode_prompt(
    codec: TextCodec,
    text: str | tuple[str, ...],
    *,
    max_tokens: int | None,
    context_limit: int,
    executor: Executor | None,
    inline_chars: int,
    add_special_tokens: bool = True,
    param: str = "prompt",
    truncate: tuple[int, str] | None = None,
) -> list[int]:
    """The prompt's token ids, refusing a prompt too long to fit before tokenizing it (unless it is
    to be truncated). Prompts up to `inline_chars` characters are tokenized inline (a thread hop
    costs more than they do). `add_special_tokens=False` for text that holds them already (a
    rendered chat template, given as `TextCodec.encode_pieces` pieces). `max_tokens` None: up to the
    context (at least one token)."""
    if truncate is None:
        whole = text if isinstance(text, str) else "".join(text)
        check_fits(min_prompt_tokens(codec, whole), max_tokens, context_limit, at_least=True, param=param)
    ids = await tokenize(
        codec, text, executor=executor, inline_chars=inline_chars, add_special_tokens=add_special_tokens
    )
    return fit_ids(ids, max_tokens, context_limit, truncate, param)


async def tokenize(
    codec: TextCodec,
    text: str | tuple[str, ...],
    *,
    executor: Executor | None,
    inline_chars: int,
    add_special_tokens: bool = True,
) -> list[int]:
    """`text`'s ids (a string, or `TextCodec.encode_pieces` pieces): inline when short, else in a
    worker thread, off the event loop."""
    loop = asyncio.get_running_loop()
    if isinstance(text, str):
        if len(text) <= inline_chars or executor is None:
            return codec.encode(text, add_special_tokens)
        return await loop.run_in_executor(executor, codec.encode_unlocked, text, add_special_tokens)
    if sum(map(len, text)) <= inline_chars or executor is None:
        return codec.encode_pieces(text, add_special_tokens)
    return await loop.run_in_executor(executor, codec.encode_pieces, text, add_special_tokens)


def fit_ids(
    ids: list[int], max_tokens: int | None, context_limit: int, truncate: tuple[int, str] | None, param: str = "prompt"
) -> list[int]:
    """Truncate a tokenized prompt as asked (vLLM's `truncate_prompt_tokens`: keep that many tokens,
    -1: as many as the context allows, from the `left` or `right` end) and check it fits."""
    if truncate is not None:
        keep, side = truncate
        if keep > context_limit:
            raise bad_request(
                f"truncate_prompt_tokens ({keep}) is over the context limit of {context_limit} tokens.",
                "truncate_prompt_tokens",
            )
        if keep == -1:  # room for the answer: max_tokens, or one token at least
            keep = context_limit - (1 if max_tokens is None else max_tokens)
        if len(ids) > keep:
            ids = ids[len(ids) - keep :] if side == "left" else ids[:keep]
        if not ids:
            raise bad_request("truncate_prompt_tokens leaves an empty prompt.", "truncate_prompt_tokens")
    check_fits(len(ids), max_tokens, context_limit, param=param)
    return ids


def resolve_max_tokens(prompt_tokens: int, max_tokens: int | None, context_limit: int, limit: int) -> int:
    """`max_tokens` None: up to the context (and the server's `--max-tokens-limit`, when set)."""
    if max_tokens is not None:
        return max_tokens
    room = context_limit - prompt_tokens
    return min(room, limit) if limit else room
