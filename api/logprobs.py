"""How a route shows token logprobs (`LogprobFormat`), and /v1/completions' format.

/v1/completions (vLLM's and OpenAI's legacy shape): columns `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`. `top_logprobs` of a token is a dict of token text -> logprob holding
the token itself and up to `logprobs` more of the most probable (so `logprobs: 0` gives just the
token's own entry); a prompt's first token has no logprob (`null` in both columns). `text_offset`
runs over a choice's whole text, echoed prompt included: each token's offset is the previous one's
plus the length of the previous token's text, as vLLM computes it. Logprobs below -9999 (minus
infinity) are shown as -9999.0, as vLLM and OpenAI do, so the JSON stays valid.
"""

from __future__ import annotations

from typing import Protocol

from ringserve.api.tokenizer import TextCodec

LOGPROB_FLOOR = -9999.0


class LogprobFormat(Protocol):
    """One entry per token, one object per streamed event, and the object of a whole choice."""

    def entry(
        self,
        codec: TextCodec,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        want: int,
        offset: int,
    ) -> tuple[object, int]:
        """A token's entry (`logprob` None: a prompt's first token) with up to `want` alternatives
        from `top`, and the length its text adds to the choice's text offset."""

    def event(self, entries: list) -> dict:
        """The logprobs object of a streamed event carrying these tokens."""

    def collect(self, entries: list) -> dict:
        """The logprobs object of a whole choice."""


def token_text(codec: TextCodec, token_id: int, as_id: bool) -> str:
    """A token as the logprobs show it: its text, or `token_id:<id>` (vLLM's
    `return_tokens_as_token_ids`, for tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{token_id}" if as_id else codec.token_text(token_id)


class CompletionLogprobs:
    """/v1/completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` columns."""

    __slots__ = ("tokens_as_ids",)

    def __init__(self, tokens_as_ids: bool = False) -> None:
        self.tokens_as_ids = tokens_as_ids

    def entry(
        self,
        codec: TextCodec,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        want: int,
        offset: int,
    ) -> tuple[tuple, int]:
        text = token_text(codec, token_id, self.tokens_as_ids)
        if logprob is None:
            return (text, None, None, offset), len(text)
        logprob = max(logprob, LOGPROB_FLOOR)
        alternatives = {text: logprob}
        if want and top:
            ids = [t for t in top if t[0] != token_id][:want]
            for tid, lp in ids:
                alternatives.setdefault(token_text(codec, tid, self.tokens_as_ids), max(lp, LOGPROB_FLOOR))
        return (text, logprob, alternatives, offset), len(text)

    def event(self, entries: list) -> dict:
        return {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries],
            "text_offset": [e[3] for e in entries],
        }

    collect = event


COMPLETION_LOGPROBS = CompletionLogprobs()
