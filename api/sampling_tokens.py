"""The sampling fields that need the tokenizer: `bad_words` become token sequences (their counts
and the vocabulary are then checked with the rest, `protocol.check_sampling`), and a structured-output
constraint becomes a grammar checked against the vocabulary (`structured_output.py`)."""

from __future__ import annotations

import msgspec

from ringserve.api.errors import bad_request
from ringserve.api.protocol import SamplingFields
from ringserve.api.state import ApiState
from ringserve.api.structured_output import StructuredSpec
from ringserve.api.tokenizer import TextCodec
from ringserve.shm.messages import SamplingParams


def finish_sampling(fields: SamplingFields, codec: TextCodec) -> SamplingParams:
    """The request's `SamplingParams`, with its bad words tokenized."""
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
    return tuple(map(tuple, out))


async def constrain(st: ApiState, spec: StructuredSpec, sampling: SamplingParams) -> SamplingParams:
    """`sampling` with the grammar of `spec` (a 400 naming the cap it passes, or the construct
    llguidance refuses)."""
    if st.grammar is None:
        raise bad_request("structured output is not available on this server.", spec.param, code="unsupported_value")
    grammar = await st.grammar.grammar(spec)
    return msgspec.structs.replace(sampling, grammar=grammar)
