"""What both generation routes share: the sampling fields (`SamplingBody`), validated once
(`parse_sampling`) into `SamplingFields`; the neutral-value rule; the model check.
`completions/protocol.py` (/v1/completions) and `chat/protocol.py` (/v1/chat/completions) build on it.

Fields are those of vLLM's OpenAI server (its request models list them; docs/api.md says how each
is treated). Three kinds:
- honoured: sampling, stops, `n`, the logits controls (penalties, `logit_bias`, `min_p`,
  `min_tokens`, `allowed_token_ids`, `bad_words`, applied on the GPU), structured output
  (`response_format`, `structured_outputs`, the `guided_*` fields: `structured_output.py`), the output options
  (`include_stop_str_in_output`, `skip_special_tokens`, `return_tokens_as_token_ids`), prompt
  truncation, prompt logprobs, `cache_salt`, `request_id`;
- accepted at their neutral values only (`check_neutral`): what would change the result if we
  ignored it (`use_beam_search`, `priority`, `repetition_detection`, ...); any
  other value is a 400 that names the field;
- unknown: ignored, as vLLM ignores them, and named in the `x-ringserve-ignored-fields` header
  (`body.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from ringserve.api.errors import ApiError, bad_request, quoted
from ringserve.api.structured_output import StructuredOutputs, StructuredSpec, structured_spec
from ringserve.rules import sampling_violation
from ringserve.shm.messages import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_TOKEN_ID,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)

MAX_N = 16
MAX_LOGPROBS = MAX_TOP_LOGPROBS
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_BAD_WORD_CHARS = 256


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingBody(msgspec.Struct, forbid_unknown_fields=True):
    """The fields /v1/completions and /v1/chat/completions share. Types only; `parse_sampling`
    validates them, once for both routes."""

    model: str | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's field): equal salts share blocks
    user: str | None = None  # OpenAI's end-user id: accepted, no effect (as in vLLM)
    request_id: str | None = None  # vLLM's: the request's id when no x-request-id header names one
    # the logits controls, applied on the GPU (gpu_proc/logits_processors.py)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # the output, in the worker
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    prompt_logprobs: int | None = None
    # structured output (`structured_output.py`): at most one of them, always honoured
    structured_outputs: StructuredOutputs | None = None
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # llguidance serves whatever this names
    guided_whitespace_pattern: str | None = None
    # accepted at their neutral values only
    use_beam_search: bool | None = False
    watermarking: bool | None = None
    priority: int | None = 0
    logprob_token_ids: list[int] | None = None
    repetition_detection: dict | None = None


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How the worker turns a sample's tokens into text and logprobs."""

    include_stop_str: bool = False  # keep the matched stop string (or stop token's text)
    skip_special_tokens: bool = True
    tokens_as_ids: bool = False  # logprob tokens as "token_id:<id>"
    min_tokens: int = 0  # no stop string ends a sample before it has more tokens than this


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The validated shared fields (see `SamplingBody`). `bad_words` are still text (the route
    tokenizes them, `prompt_tokens.bad_word_ids`); `logit_bias` and `allowed_token_ids` are in
    `sampling`, checked against the vocabulary once the request is built (`check_sampling`)."""

    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None
    request_id: str | None
    output: OutputOptions
    bad_words: tuple[str, ...]
    truncate: tuple[int, str] | None  # (tokens to keep, -1: the context; "left" | "right")
    prompt_logprobs: int | None
    structured: StructuredSpec | None = None  # the structured-output constraint asked for


def parse_sampling(body: SamplingBody) -> SamplingFields:
    """Validate the fields every generation route shares (`SamplingBody`)."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}.", "n")
    check_neutral(
        {
            "use_beam_search": (not body.use_beam_search, "false"),
            "watermarking": (not body.watermarking, "false or null"),
            "priority": (body.priority in (None, 0), "0"),
            "logprob_token_ids": (not body.logprob_token_ids, "an empty list"),
            "repetition_detection": (body.repetition_detection is None, "null"),
        }
    )
    stream = bool(body.stream)
    options = body.stream_options
    if options is not None and not stream:
        raise bad_request("stream_options can only be set when stream is true.", "stream_options")
    include_usage = options is not None and bool(options.include_usage)
    prompt_logprobs = _prompt_logprobs(body.prompt_logprobs, stream)
    if body.request_id is not None and not 1 <= len(body.request_id) <= 128:
        raise bad_request("request_id must be 1 to 128 characters.", "request_id")
    return SamplingFields(
        sampling=_sampling(body),
        stop=_stops(body.stop),
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=bool(include_usage and options is not None and options.continuous_usage_stats),
        cache_salt=_salt(body),
        request_id=body.request_id,
        output=OutputOptions(
            include_stop_str=bool(body.include_stop_str_in_output),
            skip_special_tokens=body.skip_special_tokens is not False,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            min_tokens=body.min_tokens or 0,
        ),
        bad_words=_bad_words(body.bad_words),
        truncate=_truncate(body),
        prompt_logprobs=prompt_logprobs,
        structured=structured_spec(body),
    )


def check_max_tokens(value: int, limit: int, param: str, minimum: int = 1) -> int:
    """`value` within [minimum, limit] (limit 0: no limit but the context)."""
    if value < minimum or (limit and value > limit):
        bounds = f"between {minimum} and {limit}" if limit else f"at least {minimum}"
        raise bad_request(f"{param} must be {bounds}, got {value}.", param)
    return value


def check_min_tokens(fields: SamplingFields, max_tokens: int) -> None:
    if fields.sampling.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({fields.sampling.min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens"
        )


def check_neutral(neutral: dict[str, tuple[bool, str]]) -> None:
    """`neutral` maps a field to (whether its value leaves the result unchanged, that neutral
    value as the client would write it); any other value is a 400 naming the field and its default."""
    for name, (ok, default) in neutral.items():
        if not ok:
            raise bad_request(
                f"{name} is not supported by ringserve; leave it unset or send {default}.",
                name,
                code="unsupported_value",
            )


def check_model(
    requested: str | None, served: str, aliases: frozenset[str] = frozenset(), adapters: Iterable[str] = ()
) -> str | None:
    """The LoRA adapter a request's `model` names (one of `adapters`, `--lora-modules`), or None
    for the base model. A request naming another model is refused, as OpenAI does (404
    model_not_found). The base model may be named by its id or by the path it was served from
    (vLLM's default id)."""
    if requested is None or requested == served or requested in aliases:
        return None
    if requested in adapters:
        return requested
    raise ApiError(
        404,
        f"The model {quoted(requested)} does not exist; this server serves {served!r}.",
        param="model",
        code="model_not_found",
    )


def token_ids(ids: list[int], param: str) -> tuple[int, ...]:
    if not ids:
        raise bad_request(f"{param} must not be empty.", param)
    if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        raise bad_request(f"{param} must hold token ids between 0 and {MAX_TOKEN_ID}.", param)
    return tuple(ids)


Prompt = str | tuple[int, ...]


def prompt_batch(given: str | list, param: str, limit: int) -> tuple[Prompt, ...]:
    """OpenAI's prompt shapes (completions' `prompt`, embeddings' `input`): a string, a list of
    token ids, or a batch of 1 to `limit` of either."""
    if isinstance(given, str):
        if not given:
            raise bad_request(f"{param} must not be empty.", param)
        return (given,)
    if given and all(type(x) is int for x in given):
        return (token_ids(given, param),)
    if not given or len(given) > limit:
        raise bad_request(
            f"{param} must be a non-empty string, a list of token ids, or a list of 1 to {limit} of either.", param
        )
    out: list[Prompt] = []
    for i, item in enumerate(given):
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, list) and item and all(type(x) is int for x in item):
            out.append(token_ids(item, f"{param}[{i}]"))
        else:
            raise bad_request(
                f"{param}[{i}] must be a non-empty string or a non-empty list of token ids.", f"{param}[{i}]"
            )
    return tuple(out)


def _sampling(body: SamplingBody) -> SamplingParams:
    """The body's sampling fields as the wire type, with their defaults and vLLM's spellings
    (-1 for off, a dict of biases), checked by the rule both sides apply (`rules.sampling_violation`)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    min_p = 0.0 if body.min_p is None else body.min_p
    if temperature < 1e-5:
        min_p = 0.0  # greedy: min_p cannot change the choice (vLLM drops it too)
    sp = SamplingParams(
        temperature=temperature,
        top_k=0 if body.top_k is None or body.top_k == -1 else body.top_k,  # -1: vLLM's "off"
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop_token_ids=tuple(sorted(set(token_ids(body.stop_token_ids, "stop_token_ids"))))
        if body.stop_token_ids
        else (),
        ignore_eos=body.ignore_eos,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=body.min_tokens or 0,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=_allowed(body.allowed_token_ids),
        presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
        frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
        min_p=min_p,
    )
    check_sampling(sp)
    return sp


def check_sampling(sp: SamplingParams, vocab_size: int | None = None, eos_token_ids: Iterable[int] = ()) -> None:
    """400 naming the field when `sp` breaks `rules.sampling_violation` (with `vocab_size` once the
    tokenizer is known: ids in the vocabulary, and controls that leave a token to sample)."""
    broken = sampling_violation(sp, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    if broken is not None:
        raise bad_request(broken.message, broken.param)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """`{"token id": bias}`, biases clamped to [-100, 100] as vLLM does."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:  # NOTE: before the loop below, so a huge dict costs nothing
        raise bad_request(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}.", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {quoted(key)}.", "logit_bias") from None
        if not 0 <= token <= MAX_TOKEN_ID or not math.isfinite(value):
            raise bad_request(
                f"logit_bias maps token ids (0 and up) to finite numbers; got {quoted(key)}: {value}.", "logit_bias"
            )
        out[token] = min(100.0, max(-100.0, value))
    return tuple(sorted(out.items()))


def _allowed(ids: list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if len(ids) > MAX_ALLOWED_TOKEN_IDS:  # NOTE: before sorting them
        raise bad_request(
            f"allowed_token_ids holds at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(ids)}.", "allowed_token_ids"
        )
    return tuple(sorted(set(token_ids(ids, "allowed_token_ids"))))


def _bad_words(given: list[str] | None) -> tuple[str, ...]:
    words = tuple(dict.fromkeys(given or ()))
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words holds at most {MAX_BAD_WORDS} words, got {len(words)}.", "bad_words")
    if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise bad_request(
            f"each of bad_words must be 1 to {MAX_BAD_WORD_CHARS} characters, not only spaces.", "bad_words"
        )
    return words


def _truncate(body: SamplingBody) -> tuple[int, str] | None:
    side = body.truncation_side
    if side not in (None, "left", "right"):
        raise bad_request(f"truncation_side must be 'left' or 'right', got {quoted(str(side))}.", "truncation_side")
    keep = body.truncate_prompt_tokens
    if keep is None:
        return None
    if keep < -1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the context) or >= 0, got {keep}.", "truncate_prompt_tokens"
        )
    return keep, side or "left"  # vLLM's side for generation: keep the last tokens


def _prompt_logprobs(value: int | None, stream: bool) -> int | None:
    if value is None:
        return None
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {value}.", "prompt_logprobs")
    if stream and value > 0:
        raise bad_request(
            "prompt_logprobs are not available when stream is true (as in vLLM); use "
            "echo with logprobs, or a non-streamed request.",
            "prompt_logprobs",
        )
    return value


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop holds at most {MAX_STOPS} strings, got {len(stops)}.", "stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_request(f"each stop string must be 1 to {MAX_STOP_CHARS} characters.", "stop")
    return tuple(dict.fromkeys(stops))  # dedupe, keep order


def _salt(body: SamplingBody) -> str | None:
    if body.cache_salt is not None and not 1 <= len(body.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(body.cache_salt)}.", "cache_salt"
        )
    return body.cache_salt
