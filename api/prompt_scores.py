"""A request's prompt logprobs, shown as they arrive (`PromptSheet`).

The GPU process scores a prompt a chunk per step (`rules.PROMPT_LOGPROB_TOKENS_PER_STEP` tokens);
each chunk is turned into what the response shows at once — the echoed prompt's logprob entries
(`echo` with `logprobs`) and vLLM's `prompt_logprobs` list — so the worker's CPU work follows the
GPU's pace a step at a time, instead of tens of thousands of entries built in one go when the
answer ends (which held the event loop, every other stream of the worker, for seconds). Both are
built once per prompt and shared by its `n` choices: they are the same for every choice.
"""

from __future__ import annotations

from ringserve.api.logprobs import LogprobFormat
from ringserve.api.tokenizer import TextCodec
from ringserve.shm.messages import PromptLogprobs


class PromptSheet:
    """One prompt's scores as the response shows them. `echo_logprobs`: the alternatives per
    echoed token (None: the prompt is not echoed with logprobs); `show`: vLLM's `prompt_logprobs`
    alternatives (None: that field is not shown)."""

    __slots__ = ("codec", "ids", "fmt", "echo_logprobs", "show", "echo_entries", "echo_width", "vllm", "_event")

    def __init__(
        self, codec: TextCodec, ids: list[int], fmt: LogprobFormat, echo_logprobs: int | None, show: int | None
    ) -> None:
        self.codec = codec
        self.ids = ids
        self.fmt = fmt
        self.echo_logprobs = echo_logprobs
        self.show = show
        self.echo_entries: list = []
        self.echo_width = 0  # the echoed text's length so far (the next entry's text offset)
        self.vllm: list[dict | None] = [None]  # a prompt's first token has no logprob
        self._event: dict | None = None
        if echo_logprobs is not None:
            self._echo(ids[0], None, None)

    def add(self, rec: PromptLogprobs) -> None:
        """The scores of prompt tokens `rec.start`, ... (one step's chunk)."""
        ids = self.ids[rec.start : rec.start + len(rec.logprobs)]
        tops: list = rec.top or [None] * len(ids)
        if self.echo_logprobs is not None:
            for tid, logprob, top in zip(ids, rec.logprobs, tops):
                self._echo(tid, logprob, top)
            self._event = None
        if self.show is not None:
            text, want = self.codec.token_text, self.show
            for tid, logprob, rank, top in zip(ids, rec.logprobs, rec.ranks, tops):
                entry = {tid: {"logprob": logprob, "rank": rank, "decoded_token": text(tid)}}
                for k, (alt, alt_lp) in enumerate((top or ())[:want]):
                    if alt not in entry:
                        entry[alt] = {"logprob": alt_lp, "rank": k + 1, "decoded_token": text(alt)}
                self.vllm.append(entry)

    def echo_event(self) -> dict:
        """The logprobs object of the echoed prompt's streamed event (built once)."""
        if self._event is None:
            self._event = self.fmt.event(self.echo_entries)
        return self._event

    def _echo(self, token_id: int, logprob: float | None, top) -> None:
        entry, width = self.fmt.entry(self.codec, token_id, logprob, top, self.echo_logprobs or 0, self.echo_width)
        self.echo_entries.append(entry)
        self.echo_width += width
