"""`POST /v1/completions` bodies: decoded with msgspec, validated into a frozen `CompletionRequest`;
and what both generation routes share (`SamplingBody` / `parse_sampling`, `decode_body`, the
neutral-value rule), which `chat_protocol.py` builds on for `/v1/chat/completions`.

Accepted and ignored (they never change the result at their neutral values, and we say so in the
docs): `user`, `echo: false`, `suffix: null`, `best_of` equal to `n`, `frequency_penalty: 0`,
`presence_penalty: 0`, `logit_bias: {}`. A non-neutral value of one of those, a field we do not
know, a wrong type or an out-of-range value is a 400 that names the field (`param`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from ringserve.api.errors import ApiError, bad_request
from ringserve.shm.messages import MAX_CACHE_SALT_CHARS, MAX_STOP_TOKEN_IDS, SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOPS = 16
MAX_STOP_CHARS = 256
_SEED_RANGE = (-(2**63), 2**64 - 1)
_MAX_ID = 2**31 - 1  # no vocabulary is larger; bigger ints would not even fit the wire format


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False  # OpenAI's default; /v1/completions always ends with usage
    continuous_usage_stats: bool = False


class SamplingBody(msgspec.Struct, forbid_unknown_fields=True):
    """The fields /v1/completions and /v1/chat/completions share: model, sampling, stops, n,
    streaming, the prefix-cache salt, and OpenAI fields accepted only at their neutral values.
    Types only; `parse_sampling` validates them, once for both routes."""

    model: str | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's field): equal salts share blocks
    # accepted and ignored at their neutral values
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class _Body(SamplingBody):
    """The /v1/completions wire shape; types only. Ranges and cross-field rules are checked in
    `parse_body`."""

    prompt: str | list | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    logprobs: int | None = None
    # accepted and ignored at their neutral values
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The validated shared fields (see `SamplingBody`)."""

    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    stream: bool
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated completion request; exactly one of `prompt_text` and `prompt_ids` is set."""

    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    model: str | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    logprobs: int | None
    stream: bool
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt_text is None) == (self.prompt_ids is None):
            raise ValueError("exactly one of prompt_text and prompt_ids must be set")


_decoder = msgspec.json.Decoder(_Body)
_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_AT = re.compile(r"at `\$\.([^`]+)`")


def decode_body(decoder: msgspec.json.Decoder, raw: bytes):
    """Decode a JSON request body, raising `ApiError(400)` that names the offending field."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        text = str(exc)
        unknown = _UNKNOWN.search(text)
        if unknown:
            raise bad_request(f"Unknown field {unknown.group(1)!r}{_where(text)}: ringserve does not "
                              "support it and it could change the result.", unknown.group(1),
                              code="unknown_field") from None
        path = _PATH.search(text)
        raise bad_request(f"Invalid request body: {text}", path.group(1) if path else None,
                          code="invalid_type") from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", None, code="invalid_json") from None
    except RecursionError:  # msgspec's error for arrays or objects nested about 1,000 deep
        raise bad_request("Request body is nested too deeply; no field of a completion request "
                          "nests more than two levels.", None, code="invalid_json") from None
    except UnicodeDecodeError as exc:  # msgspec's error for invalid UTF-8 inside a string
        raise bad_request(f"Request body is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                          "JSON text must be UTF-8.", None, code="invalid_json") from None


def _where(text: str) -> str:
    """` in messages[0]` for an unknown field inside an object of the body ('' at the top)."""
    at = _AT.search(text)
    return f" in {at.group(1)}" if at else ""


def parse_body(raw: bytes, *, max_tokens_limit: int, default_max_tokens: int = 16) -> CompletionRequest:
    """Decode and validate a request body, raising `ApiError(400)` naming the offending field."""
    body = decode_body(_decoder, raw)
    _check_ignored(body)
    prompt_text, prompt_ids = _prompt(body)
    max_tokens = check_max_tokens(default_max_tokens if body.max_tokens is None else body.max_tokens,
                                  max_tokens_limit, "max_tokens")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}.",
                          "logprobs")
    common = parse_sampling(body)
    return CompletionRequest(prompt_text=prompt_text, prompt_ids=prompt_ids, model=body.model,
                             max_tokens=max_tokens, sampling=common.sampling, stop=common.stop,
                             n=common.n, logprobs=body.logprobs, stream=common.stream,
                             cache_salt=common.cache_salt)


def check_max_tokens(value: int, limit: int, param: str) -> int:
    if not 1 <= value <= limit:
        raise bad_request(f"{param} must be between 1 and {limit}, got {value}.", param)
    return value


def parse_sampling(body: SamplingBody) -> SamplingFields:
    """Validate the fields every generation route shares (`SamplingBody`)."""
    if not 1 <= body.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {body.n}.", "n")
    check_neutral({
        "frequency_penalty": body.frequency_penalty in (None, 0.0),
        "presence_penalty": body.presence_penalty in (None, 0.0),
        "logit_bias": not body.logit_bias,
    })
    return SamplingFields(sampling=_sampling(body), stop=_stops(body.stop), n=body.n,
                          stream=body.stream, cache_salt=_salt(body))


def _prompt(body: _Body) -> tuple[str | None, tuple[int, ...] | None]:
    given = [name for name in ("prompt", "prompt_token_ids") if getattr(body, name) is not None]
    if len(given) != 1:
        raise bad_request("Send exactly one of 'prompt' and 'prompt_token_ids'.", "prompt",
                          code="missing_prompt" if not given else "invalid_value")
    if body.prompt_token_ids is not None:
        return None, _token_ids(body.prompt_token_ids, "prompt_token_ids")
    prompt = body.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty.", "prompt")
        return prompt, None
    # A list: token ids, or a batch of one string/one id list (OpenAI shapes). Larger batches
    # would change the response shape; we ask for one prompt per request.
    if prompt and all(type(x) is int for x in prompt):
        return None, _token_ids(prompt, "prompt")
    if len(prompt) == 1 and isinstance(prompt[0], str) and prompt[0]:
        return prompt[0], None
    if len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0] and all(type(x) is int for x in prompt[0]):
        return None, _token_ids(prompt[0], "prompt")
    raise bad_request("prompt must be a non-empty string or a list of token ids; batched prompts "
                      "are not supported, send one request per prompt.", "prompt")


def _token_ids(ids: list[int], param: str) -> tuple[int, ...]:
    if not ids:
        raise bad_request(f"{param} must not be empty.", param)
    if min(ids) < 0 or max(ids) > _MAX_ID:
        raise bad_request(f"{param} must hold token ids between 0 and {_MAX_ID}.", param)
    return tuple(ids)


def _sampling(body: SamplingBody) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be between 0 and 2, got {temperature}.", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = 0 if body.top_k is None or body.top_k == -1 else body.top_k  # -1: vLLM's "off"
    if not 0 <= top_k <= _MAX_ID:
        raise bad_request(f"top_k must be >= 0 (0 or -1: off), got {top_k}.", "top_k")
    if body.seed is not None and not _SEED_RANGE[0] <= body.seed <= _SEED_RANGE[1]:
        raise bad_request("seed must fit in 64 bits.", "seed")
    stop_ids = ()
    if body.stop_token_ids:
        if len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got "
                              f"{len(body.stop_token_ids)}.", "stop_token_ids")
        stop_ids = tuple(sorted(set(_token_ids(body.stop_token_ids, "stop_token_ids"))))
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=body.seed,
                          stop_token_ids=stop_ids, ignore_eos=body.ignore_eos)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop holds at most {MAX_STOPS} strings, got {len(stops)}.", "stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_request(f"each stop string must be 1 to {MAX_STOP_CHARS} characters.", "stop")
    return tuple(dict.fromkeys(stops))  # dedupe, keep order


def _check_ignored(body: _Body) -> None:
    """/v1/completions fields we accept only at values that leave the result unchanged."""
    check_neutral({
        "echo": body.echo is False,
        "suffix": body.suffix in (None, ""),
        "best_of": body.best_of in (None, body.n),
    })


def check_neutral(neutral: dict[str, bool]) -> None:
    """`neutral` maps a field to whether its value leaves the result unchanged; any other is 400."""
    for name, ok in neutral.items():
        if not ok:
            raise bad_request(f"{name} is not supported by ringserve; leave it unset or at its "
                              "default.", name, code="unsupported_value")


def check_model(requested: str | None, served: str) -> None:
    """A request naming another model is refused, as OpenAI does (404 model_not_found)."""
    if requested is not None and requested != served:
        raise ApiError(404, f"The model {requested!r} does not exist; this server serves {served!r}.",
                       param="model", code="model_not_found")


def _salt(body: SamplingBody) -> str | None:
    if body.cache_salt is not None and not 1 <= len(body.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, got "
                          f"{len(body.cache_salt)}.", "cache_salt")
    return body.cache_salt
