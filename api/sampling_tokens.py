"""The sampling fields that need the tokenizer: `bad_words` become token sequences, and
`logit_bias` / `allowed_token_ids` must name tokens of the vocabulary."""

from __future__ import annotations

import msgspec

from ringserve.api.errors import bad_request
from ringserve.api.protocol import SamplingFields, check_token_ids
from ringserve.api.tokenizer import TextCodec
from ringserve.shm.messages import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams


def finish_sampling(fields: SamplingFields, codec: TextCodec) -> SamplingParams:
    """The request's `SamplingParams`, with its bad words tokenized."""
    check_token_ids(fields, codec.vocab_size)
    if not fields.bad_words:
        return fields.sampling
    return msgspec.structs.replace(fields.sampling, bad_words=bad_word_ids(codec, fields.bad_words))


def bad_word_ids(codec: TextCodec, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words`: each word as written (leading spaces dropped) and, when
    that gives a different first token of the same length, with one leading space, so a word is
    banned at the start of the text and after a space alike."""
    out: list[list[int]] = []
    for word in words:
        for spaced in (False, True):
            ids = codec.encode((" " if spaced else "") + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not spaced:
                    raise bad_request(f"bad_words entry {word!r} encodes to no tokens.", "bad_words")
                continue
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    if len(out) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words encode to {len(out)} token sequences; at most {MAX_BAD_WORDS}.", "bad_words")
    if max(map(len, out)) > MAX_BAD_WORD_TOKENS:
        raise bad_request(f"each of bad_words may encode to at most {MAX_BAD_WORD_TOKENS} tokens.", "bad_words")
    return tuple(map(tuple, out))
