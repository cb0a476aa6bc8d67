"""When a sequence stops, decided in the engine right after each sampled token (pure Python)."""

from __future__ import annotations


def stop_reason(
    token_id: int,
    num_generated: int,
    context_len: int,
    *,
    eos_token_ids: frozenset[int] | set[int],
    stop_token_ids: frozenset[int] = frozenset(),
    ignore_eos: bool = False,
    max_tokens: int,
    context_limit: int,
) -> str | None:
    """`"stop"`, `"length"` or None for a sequence that just sampled `token_id`.

    `num_generated` and `context_len` already count `token_id`. Both id sets are frozensets: this
    runs for every sampled token of every row, so a lookup must not cost the set's size (a request
    holds at most `shm.messages.MAX_STOP_TOKEN_IDS`). A stop token ends the answer
    (OpenAI reports `stop`); `ignore_eos` disables EOS but never the caller's own
    `stop_token_ids`. Reaching `max_tokens` or the context limit is `length`.
    """
    if token_id in stop_token_ids or (not ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_generated >= max_tokens or context_len >= context_limit:
        return "length"
    return None
