"""A prompt that cannot fit is refused before it is tokenized, and tokenizing never holds the
event loop (issue 15, break 1: 3.9 MB prompts froze a worker until the watchdog killed it)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.api.prompt_limits import min_prompt_tokens
from ringserve.api.tokenizer import TextCodec


class CountingCodec(TextCodec):
    """The real codec, counting how often it tokenizes."""

    calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return super().encode(text, add_special_tokens)

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return super().encode_unlocked(text, add_special_tokens)


@pytest.fixture(scope="module")
def specials(tiny_model_dir) -> list[str]:
    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return [t.content for t in tok.get_added_tokens_decoder().values()]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_byte_bound_never_exceeds_the_real_token_count(codec, specials, data):
    """For any text (multi-byte characters and special-token strings included) the bound from
    its UTF-8 length is at most the number of tokens it encodes to."""
    pieces = st.one_of(
        st.text(max_size=40), st.sampled_from(specials), st.text(alphabet="ab \n\u00e9\u4e2d\U0001f600", max_size=40)
    )
    text = "".join(data.draw(st.lists(pieces, max_size=12)))
    assert min_prompt_tokens(codec, text) <= len(codec.encode(text))


def test_no_bound_for_tokenizers_that_shrink_text(tiny_model_dir):
    """A normalizer or pre-tokenizer that can shorten or drop text makes the bound unknown (no
    early refusal), never a wrong one."""
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    assert TextCodec(tokenizers.Tokenizer.from_str(json.dumps(spec))).max_token_bytes == 20
    for key, value in (
        ("normalizer", {"type": "NFKC"}),
        ("normalizer", {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]}),
        ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, spec["pre_tokenizer"]]}),
    ):
        changed = dict(spec, **{key: value})
        assert TextCodec(tokenizers.Tokenizer.from_str(json.dumps(changed))).max_token_bytes is None


@pytest.mark.asyncio
async def test_huge_prompt_is_refused_without_tokenizing(serve, tiny_model_dir):
    """A 3.9 MB prompt (under the body limit, far over the context) is a 400 at once: the
    tokenizer never sees it."""
    served = await serve()
    counting = CountingCodec.from_dir(tiny_model_dir)
    served.state.codec = counting
    text = ("The quick brown fox jumps over the lazy dog. " * 90000)[:3_900_000]
    t0 = time.monotonic()
    resp = await served.client.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert counting.calls == 0
    assert time.monotonic() - t0 < 5.0
    # Just inside the bound it is tokenized, and the exact count decides.
    near = text[: (8192 - 4) * counting.max_token_bytes]
    resp = await served.client.post("/v1/completions", json={"prompt": near, "max_tokens": 4})
    assert resp.status == 400 and counting.calls == 1
    assert "at least" not in (await resp.json())["error"]["message"]


@pytest.mark.asyncio
async def test_prompt_token_ids_over_the_context_are_refused(serve):
    """prompt_token_ids longer than the context are refused by their count alone."""
    served = await serve()
    resp = await served.client.post("/v1/completions", json={"prompt": [5] * 8200, "max_tokens": 1})
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "context_length_exceeded"
    assert not served.fake.submits


@pytest.mark.asyncio
async def test_event_loop_keeps_answering_while_a_long_prompt_tokenizes(serve, codec):
    """While a prompt that takes about a second to tokenize is in flight, /health still answers
    in a fraction of that time: tokenizing runs off the loop without holding the GIL."""
    served = await serve(context_limit=2_000_000, max_tokens_limit=16)
    text = ("The quick brown fox jumps over the lazy dog. " * 40000)[:1_600_000]
    t0 = time.monotonic()
    codec.encode(text)
    encode_s = time.monotonic() - t0
    worst = 0.0
    probing = True

    async def probe() -> None:
        """/health in a loop; `worst`: the longest round (answer plus a 10 ms pause) beyond 10 ms,
        which also catches a loop blocked while the probe pauses."""
        nonlocal worst
        while probing:
            t = time.monotonic()
            resp = await served.client.get("/health")
            assert resp.status == 200
            await asyncio.sleep(0.01)
            worst = max(worst, time.monotonic() - t - 0.01)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.1)
    resp = await served.client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    probing = False
    await prober
    assert resp.status == 200
    assert len(served.fake.submits[0].prompt_ids) == len(codec.encode(text))
    assert worst < max(0.2, encode_s / 3), (worst, encode_s)
