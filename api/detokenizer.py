"""Incremental detokenization: token ids in, text out, never half a UTF-8 character.

Fast path: the codec's token -> bytes table and Python's incremental UTF-8 decoder, which holds an
incomplete multi-byte sequence until its last byte arrives (an emoji split over four byte tokens
yields "" three times, then the emoji). Fallback for tokenizers without a byte table: decode a
sliding window of ids and emit only the stable, complete part (the vLLM prefix/read-offset rule).
"""

from __future__ import annotations

import codecs

from ringserve.api.tokenizer import TextCodec

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Per-sample streaming detokenizer; `push(token_id)` returns the newly completed text.
    `skip_special_tokens=False` shows special tokens' text (vLLM's option)."""

    __slots__ = ("_table", "_skip", "_utf8", "_codec", "_ids", "_prefix", "_read")

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self._table = codec.byte_table if skip_special_tokens else codec.byte_table_with_specials
        self._skip = skip_special_tokens
        # errors="replace": bytes that can never form a character become U+FFFD, as decode() does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._table is not None else None
        self._codec = codec
        self._ids: list[int] = []
        self._prefix = 0  # window start for the fallback
        self._read = 0  # ids already turned into emitted text

    def push(self, token_id: int) -> str:
        table, utf8 = self._table, self._utf8
        if table is not None and utf8 is not None:
            piece = table[token_id] if 0 <= token_id < len(table) else b""
            return utf8.decode(piece)
        return self._push_window(token_id)

    def flush(self) -> str:
        """Text still held at the end of a sample (an incomplete character becomes U+FFFD)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        if self._read == len(self._ids):
            return ""
        prefix_text = self._codec.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._codec.decode(self._ids[self._prefix :], self._skip)
        self._read = len(self._ids)
        return text[len(prefix_text) :]

    def _push_window(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        prefix_text = self._codec.decode(ids[self._prefix : self._read], self._skip)
        text = self._codec.decode(ids[self._prefix :], self._skip)
        # A trailing U+FFFD means the last ids end inside a character: wait for more.
        if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT):
            new = text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(ids)
            return new
        return ""
