"""The worker's view of a tokenizer: encode prompts, and a token -> bytes table for detokenizing.

Wraps a `tokenizers.Tokenizer` (or the `backend_tokenizer` of a transformers fast tokenizer). For
byte-level BPE (GPT-2 / Llama 3 style) and byte-fallback SentencePiece (Llama 2 style) vocabularies
every token maps to a fixed byte string, so detokenizing is a table lookup plus an incremental
UTF-8 decoder; `byte_table` is None for any other decoder and the detokenizer falls back to
decoding a window of ids.

`max_token_bytes` bounds how much prompt text one token can stand for, so a prompt's byte length
gives a lower bound on its token count before it is tokenized (`prompt_limits.py`). It is derived
only when the tokenizer's pipeline never drops or shortens text; otherwise it is None.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import tokenizers


@lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in character -> byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TextCodec:
    """Encode text to ids and map ids back to bytes; shared read-only by every request."""

    def __init__(self, tokenizer: tokenizers.Tokenizer | object) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer or a fast tokenizer, got {type(tokenizer)!r}")
        self.tokenizer = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        spec = json.loads(backend.to_str())
        self.byte_table = _build_byte_table(backend, spec, self.special_ids)
        self.max_token_bytes = _max_token_bytes(backend, spec, self.byte_table)
        self._with_specials: list[bytes] | None = None
        self._plain: tokenizers.Tokenizer | None = None
        self._texts: list[str | None] = [None] * self.vocab_size

    @property
    def byte_table_with_specials(self) -> list[bytes] | None:
        """`byte_table` with the special tokens' text (for `skip_special_tokens: false`)."""
        if self._with_specials is None and self.byte_table is not None:
            table = list(self.byte_table)
            for i, tok in self.tokenizer.get_added_tokens_decoder().items():
                table[i] = tok.content.encode()
            self._with_specials = table
        return self._with_specials

    @classmethod
    def from_dir(cls, path: str | Path) -> TextCodec:
        return cls(tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids, with the model's special tokens (e.g. BOS) added as the tokenizer says;
        `add_special_tokens=False` for text that already holds them (a rendered chat template)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_id(self, token: str) -> int | None:
        """The id of one token string (a special token's text), None if it is not in the vocabulary."""
        return self.tokenizer.token_to_id(token)

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` for a worker thread: `encode_batch` releases the GIL while the tokenizer runs
        (`encode` does not), so the event loop keeps running beside it."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pieces(self, pieces: tuple[str, ...], add_special_tokens: bool = False) -> list[int]:
        """Ids of text in pieces that alternate: pieces at even positions are encoded as `encode`
        does (a special token's text there is that token), pieces at odd positions as plain text
        (a special token's text there is ordinary tokens: `<`, `|`, `im`, ...). A rendered chat
        template's own markers stay special; a client's copy of one does not. Runs in a worker
        thread (`encode_batch` releases the GIL)."""
        if len(pieces) == 1:
            return self.encode_unlocked(pieces[0], add_special_tokens)
        special = self.tokenizer.encode_batch(list(pieces[0::2]), add_special_tokens=False)
        plain = self._plain_text().encode_batch(list(pieces[1::2]), add_special_tokens=False)
        merged = [e for pair in zip(special, plain) for e in pair] + special[len(plain) :]
        encoding = tokenizers.Encoding.merge(merged, growing_offsets=True)
        if add_special_tokens:
            encoding = self.tokenizer.post_process(encoding, add_special_tokens=True)
        return encoding.ids

    def _plain_text(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads special tokens' text as text."""
        if self._plain is None:
            plain = tokenizers.Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The special tokens' text, longest first (a longer one may hold a shorter one)."""
        added = self.tokenizer.get_added_tokens_decoder()
        return tuple(sorted((added[i].content for i in self.special_ids), key=len, reverse=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as `decode([token_id])` gives it, from a table filled as tokens are
        met: logprobs show tens of thousands of tokens per response, each a tokenizer call."""
        texts = self._texts
        if 0 <= token_id < len(texts):
            text = texts[token_id]
            if text is None:
                text = texts[token_id] = self.tokenizer.decode([token_id])
            return text
        return self.tokenizer.decode([token_id])


def _build_byte_table(tok: tokenizers.Tokenizer, spec: dict, special_ids: frozenset[int]) -> list[bytes] | None:
    decoder = spec.get("decoder") or {}
    kinds = (
        [d.get("type") for d in decoder.get("decoders", [])]
        if decoder.get("type") == "Sequence"
        else [decoder.get("type")]
    )
    vocab = tok.get_vocab(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    table: list[bytes] = [b""] * (max(vocab.values()) + 1 if vocab else 0)
    if kinds == ["ByteLevel"]:
        inverse = _byte_level_inverse()
        for piece, i in vocab.items():
            if i in added:
                continue
            try:
                table[i] = bytes(inverse[ch] for ch in piece)
            except KeyError:
                return None  # a piece outside the byte alphabet: not a pure byte-level vocab
    elif _is_sentencepiece_byte_fallback(decoder, kinds):
        for piece, i in vocab.items():
            if i in added:
                continue
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table[i] = bytes([int(piece[3:5], 16)])
            else:
                table[i] = piece.replace("\u2581", " ").encode()
        # NOTE: a generated continuation keeps its leading space (the text follows the prompt),
        # so the decoder's Strip step, which applies to a whole text's start, is not mirrored.
    else:
        return None
    for i, tok_ in added.items():
        table[i] = b"" if i in special_ids else tok_.content.encode()
    return table


def _is_sentencepiece_byte_fallback(decoder: dict, kinds: list) -> bool:
    return (
        decoder.get("type") == "Sequence"
        and "ByteFallback" in kinds
        and "Fuse" in kinds
        and set(kinds) <= {"Replace", "ByteFallback", "Fuse", "Strip"}
    )


# Pipeline steps that never drop or shorten text: with only these, the bytes of a prompt's tokens
# (`byte_table`, or an added token's content) add up to at least the prompt's own bytes.
_KEEPING_NORMALIZERS = frozenset({"Prepend", "Replace"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def _steps(node: dict | None, key: str) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [step for child in node.get(key) or [] for step in _steps(child, key)]
    return [node]


def _keeps_text(spec: dict) -> bool:
    for step in _steps(spec.get("normalizer"), "normalizers"):
        if step.get("type") not in _KEEPING_NORMALIZERS:
            return False  # NFC/NFKC, Lowercase, Strip, ... can make text shorter
        if step["type"] == "Replace":
            pattern = (step.get("pattern") or {}).get("String")
            if pattern is None or len(step.get("content", "").encode()) < len(pattern.encode()):
                return False
    pre = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    for step in pre:
        if step.get("type") not in _KEEPING_PRE_TOKENIZERS or step.get("behavior") == "Removed" or step.get("invert"):
            return False  # Whitespace, BertPreTokenizer, ... drop characters
    model = spec.get("model") or {}
    # Every character must become tokens of its own bytes, never an <unk> for a run of them.
    return model.get("type") == "BPE" and bool(
        model.get("byte_fallback") or any(step["type"] == "ByteLevel" for step in pre)
    )


def _max_token_bytes(tok: tokenizers.Tokenizer, spec: dict, table: list[bytes] | None) -> int | None:
    """The most prompt bytes one token can stand for, or None when that cannot be bounded."""
    if table is None or not _keeps_text(spec):
        return None
    added = [len(t.content.encode()) for t in tok.get_added_tokens_decoder().values()]
    return max([len(b) for b in table] + added + [1])
