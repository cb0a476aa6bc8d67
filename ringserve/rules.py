"""The request rules both sides apply, written once (docs/design.md#limits-and-timeouts).

Pure functions, importable by every layer like `ringserve.config`: the API workers use them to
refuse a request early, with the same message the GPU process would give, and their fake GPU
follows them; the GPU process enforces them on every Submit, whatever a worker let through; the
scheduling core decides with them when a sequence has finished.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ringserve.shm import messages as M
from ringserve.shm.messages import FinishReason


def finish_reason(
    token_id: int,
    num_generated: int,
    context_len: int,
    *,
    eos_token_ids: frozenset[int] | set[int],
    stop_token_ids: frozenset[int] = frozenset(),
    ignore_eos: bool = False,
    max_tokens: int,
    context_limit: int,
) -> FinishReason | None:
    """`STOP`, `LENGTH` or None for a sequence that just sampled `token_id`.

    `num_generated` and `context_len` already count `token_id`. Both id sets are frozensets: this
    runs for every sampled token of every row, so a lookup must not cost the set's size (a request
    holds at most `shm.messages.MAX_STOP_TOKEN_IDS`). A stop token ends the answer
    (OpenAI reports `stop`); `ignore_eos` disables EOS but never the caller's own
    `stop_token_ids`. Reaching `max_tokens` or the context limit is `length`.
    """
    if token_id in stop_token_ids or (not ignore_eos and token_id in eos_token_ids):
        return FinishReason.STOP
    if num_generated >= max_tokens or context_len >= context_limit:
        return FinishReason.LENGTH
    return None


# Prompt tokens whose logprobs one step computes, all rows together: each needs a row of logits
# (positions x vocabulary floats on the device) and its logprobs travel in the step's output record
# (`shm.messages.max_step_output_bytes`). A longer prompt is scored over several chunks.
PROMPT_LOGPROB_TOKENS_PER_STEP = 256


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def context_error(
    prompt_tokens: int, max_tokens: int | None, context_limit: int, *, at_least: bool = False
) -> str | None:
    """Why a prompt and its answer cannot fit the context (None: they fit). `max_tokens` None: the
    client set no fixed length (or only a cap), so the answer needs one token at least; 0: the
    prompt alone (/tokenize). With `at_least`, the prompt's count is a lower bound (from its length
    in bytes, before tokenizing)."""
    if prompt_tokens + (1 if max_tokens is None else max_tokens) <= context_limit:
        return None
    count = f"at least {prompt_tokens} tokens (from its length in bytes)" if at_least else f"{prompt_tokens} tokens"
    if max_tokens is None:
        return (
            f"prompt ({count}) leaves no room for an answer in the context limit of {context_limit} "
            "tokens; shorten the prompt."
        )
    if max_tokens == 0:
        return f"prompt ({count}) is over the context limit of {context_limit} tokens; shorten the prompt."
    return (
        f"prompt ({count}) + max_tokens ({max_tokens}) is over the context limit of {context_limit} "
        f"tokens; shorten the prompt or lower max_tokens."
    )


# repetition_penalty divides the positive logits of seen tokens and multiplies the others. Far
# outside this range they overflow float32 (then the temperature divides them again), the row's
# distribution turns to NaN, and top-p sampling indexed out of bounds: one request with 1e-40
# crashed the GPU process twice. Inside it, the effect is already all but absolute.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def repetition_penalty_error(value: float) -> str | None:
    """Why a repetition_penalty cannot be applied (None: it can)."""
    low, high = REPETITION_PENALTY_RANGE
    if low <= value <= high:  # False for NaN too
        return None
    return f"repetition_penalty must be between {low:g} and {high:g} (1: off), got {value}."


def vocabulary_error(token_ids: Iterable[int], vocab_size: int, what: str = "prompt") -> str | None:
    """Why `token_ids` cannot be fed to a model of `vocab_size` tokens (None: every id is in it)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is None:
        return None
    return f"{what} holds token id {bad}, outside the vocabulary (0..{vocab_size - 1})."


def constraints_error(
    *,
    allowed_token_ids: Iterable[int],
    stop_token_ids: Iterable[int],
    eos_token_ids: Iterable[int],
    min_tokens: int,
    bad_words: Iterable[Iterable[int]],
    vocab_size: int,
) -> str | None:
    """Why a request's logits controls could mask every token (None: one is always left).

    The masks: only `allowed_token_ids` (empty: every token); never the last token of a bad word
    (always for a one-token word, after its other tokens for a longer one); never a stop token or
    EOS before `min_tokens` tokens. A request for which no token escapes every mask at once could
    reach a step with nothing to sample, and a constraint would have to break; it is refused
    instead (sound, and strict only for bad words longer than one token).
    """
    banned = {words_[-1] for words_ in map(tuple, bad_words) if words_}
    if min_tokens > 0:
        banned |= set(stop_token_ids) | set(eos_token_ids)
    allowed = set(allowed_token_ids)
    if allowed:
        if allowed - banned:
            return None
        what = "allowed_token_ids"
    elif len({t for t in banned if 0 <= t < vocab_size}) < vocab_size:
        return None
    else:
        what = "the vocabulary"
    return (
        f"these constraints leave no token to sample: every token of {what} is a stop token or EOS "
        f"(banned until min_tokens ({min_tokens}) tokens are out) or the last token of one of bad_words. "
        "Allow a token that is neither, or drop min_tokens or those bad_words."
    )


@dataclass(frozen=True, slots=True)
class Violation:
    """A rule a request breaks: the field to name (the OpenAI error's `param`) and why."""

    param: str
    message: str


SEED_RANGE = (-(2**63), 2**64 - 1)


def sampling_violation(
    sp: M.SamplingParams, *, vocab_size: int | None = None, eos_token_ids: Iterable[int] = ()
) -> Violation | None:
    """The one check of a request's sampling settings (`shm.messages.SamplingParams`), or None.

    The API worker runs it on the parsed body (without `vocab_size`: before tokenizing) and again
    once the vocabulary is known; the GPU process runs it on every Submit with its own vocabulary
    and EOS ids, because the ring is a trust boundary. Both answer with the same message.
    """
    checks = (
        ("temperature", 0.0 <= sp.temperature <= 2.0, f"temperature must be between 0 and 2, got {sp.temperature}."),
        ("top_p", 0.0 < sp.top_p <= 1.0, f"top_p must be in (0, 1], got {sp.top_p}."),
        ("top_k", 0 <= sp.top_k <= M.MAX_TOKEN_ID, f"top_k must be >= 0 (0 or -1: off), got {sp.top_k}."),
        ("seed", sp.seed is None or SEED_RANGE[0] <= sp.seed <= SEED_RANGE[1], "seed must fit in 64 bits."),
        (
            "presence_penalty",
            -2.0 <= sp.presence_penalty <= 2.0,
            f"presence_penalty must be between -2 and 2, got {sp.presence_penalty}.",
        ),
        (
            "frequency_penalty",
            -2.0 <= sp.frequency_penalty <= 2.0,
            f"frequency_penalty must be between -2 and 2, got {sp.frequency_penalty}.",
        ),
        ("min_p", 0.0 <= sp.min_p <= 1.0, f"min_p must be between 0 and 1, got {sp.min_p}."),
        ("min_tokens", sp.min_tokens >= 0, f"min_tokens must be >= 0, got {sp.min_tokens}."),
        (
            "stop_token_ids",
            len(sp.stop_token_ids) <= M.MAX_STOP_TOKEN_IDS,
            f"stop_token_ids holds at most {M.MAX_STOP_TOKEN_IDS} ids, got {len(sp.stop_token_ids)}.",
        ),
        (
            "logit_bias",
            len(sp.logit_bias) <= M.MAX_LOGIT_BIAS,
            f"logit_bias holds at most {M.MAX_LOGIT_BIAS} tokens, got {len(sp.logit_bias)}.",
        ),
        (
            "logit_bias",
            all(math.isfinite(b) and -100.0 <= b <= 100.0 for _, b in sp.logit_bias),
            "logit_bias values must be finite numbers in [-100, 100].",
        ),
        (
            "allowed_token_ids",
            len(sp.allowed_token_ids) <= M.MAX_ALLOWED_TOKEN_IDS,
            f"allowed_token_ids holds at most {M.MAX_ALLOWED_TOKEN_IDS} ids, got {len(sp.allowed_token_ids)}.",
        ),
        (
            "bad_words",
            len(sp.bad_words) <= M.MAX_BAD_WORDS,
            f"bad_words encode to {len(sp.bad_words)} token sequences; at most {M.MAX_BAD_WORDS}.",
        ),
        (
            "bad_words",
            all(1 <= len(w) <= M.MAX_BAD_WORD_TOKENS for w in sp.bad_words),
            f"each of bad_words must encode to 1 to {M.MAX_BAD_WORD_TOKENS} tokens.",
        ),
        (
            "response_format",
            sp.grammar is None or 0 < len(sp.grammar) <= M.MAX_GRAMMAR_CHARS,
            f"a structured-output schema or grammar must be 1 to {M.MAX_GRAMMAR_CHARS} characters once compiled.",
        ),
    )
    for param, ok, message in checks:
        if not ok:  # NOTE: a NaN fails every range above
            return Violation(param, message)
    penalty = repetition_penalty_error(sp.repetition_penalty)
    if penalty is not None:
        return Violation("repetition_penalty", penalty)
    limit = M.MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    # NOTE: stop ids outside the vocabulary are harmless (never sampled); only their range is checked.
    groups = (
        ("stop_token_ids", sp.stop_token_ids, M.MAX_TOKEN_ID + 1),
        ("logit_bias", [t for t, _ in sp.logit_bias], limit),
        ("allowed_token_ids", sp.allowed_token_ids, limit),
        ("bad_words", [t for words in sp.bad_words for t in words], limit),
    )
    for param, ids, size in groups:
        outside = vocabulary_error(ids, size, param)
        if outside is not None:
            return Violation(param, outside)
    if vocab_size is not None:
        masked = constraints_error(
            allowed_token_ids=sp.allowed_token_ids,
            stop_token_ids=sp.stop_token_ids,
            eos_token_ids=eos_token_ids,
            min_tokens=sp.min_tokens,
            bad_words=sp.bad_words,
            vocab_size=vocab_size,
        )
        if masked is not None:
            return Violation("allowed_token_ids" if sp.allowed_token_ids else "min_tokens", masked)
    return None


def submit_violation(msg: M.Submit, vocab_size: int, eos_token_ids: Iterable[int]) -> Violation | None:
    """What the GPU process checks on a Submit, whatever the worker let through: the sampling
    rule, the logprobs limits and the prompt's vocabulary (an id outside it would index past the
    logits; controls that mask every token would have to break one)."""
    found = sampling_violation(msg.sampling, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    if found is not None:
        return found
    for param, value in (("logprobs", msg.logprobs), ("prompt_logprobs", msg.prompt_logprobs)):
        if value is not None and not 0 <= value <= M.MAX_TOP_LOGPROBS:
            return Violation(param, f"{param} must be between 0 and {M.MAX_TOP_LOGPROBS}, got {value}.")
    if msg.pooling is not None and (msg.pooling not in M.POOLING_TYPES or msg.n != 1 or msg.max_tokens != 1):
        return Violation("pooling", f"pooling is one of {', '.join(M.POOLING_TYPES)}, with n 1 and max_tokens 1.")
    outside = vocabulary_error(msg.prompt_ids, vocab_size)
    return None if outside is None else Violation("prompt", outside)


# Structured output (docs/design.md#structured-output). What a grammar costs grows faster than its
# text: llguidance's GBNF-to-Lark conversion is quadratic in pure Python (2,000 rules: 6 s), a
# schema's patternProperties make its compile superlinear (450 of them: 9 to 12 s), and a chain of
# about 2,800 rules overflows the compiler's stack. So the text is measured before any of it is
# converted, and what then runs has a deadline (`grammar_timeout_s`): the worker converts and checks
# in a child process it kills past it, the GPU process compiles off its loop within twice that.
GRAMMAR_TOO_COMPLEX = "grammar_too_complex"
MAX_CHOICES = 1024  # strings of a `choice` constraint

_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?(?:\[[^\]\n]*\])?(?:\{[^}\n]*\})?[ \t]*:(?![:=])", re.M)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][\w.-]*[ \t]*::=", re.M)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """The structured-output caps of one server (`Config.grammar_*`)."""

    max_rules: int
    max_patterns: int
    timeout_s: float

    @classmethod
    def of(cls, config) -> GrammarLimits:
        return cls(config.grammar_max_rules, config.grammar_max_patterns, config.grammar_timeout_s)


def grammar_rules(text: str) -> int:
    """Rule (and terminal) definitions in a Lark or GBNF grammar: each `name:` or `name ::=` that
    opens a line. A definition-like line inside a string counts too; the count errs high."""
    return len(_LARK_RULE.findall(text)) + len(_GBNF_RULE.findall(text))


def schema_patterns(schema: object) -> int:
    """`patternProperties` patterns in a JSON schema, every object of it together."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            pp = node.get("patternProperties")
            if isinstance(pp, dict):
                count += len(pp)
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return count


def grammar_size_error(what: str, chars: int) -> str | None:
    """Why a schema (as compact JSON) or grammar text of `chars` characters is refused unread."""
    if chars <= M.MAX_GRAMMAR_CHARS:
        return None
    return (
        f"{what} is {chars} characters; a structured-output schema (as compact JSON) or grammar may have "
        f"at most {M.MAX_GRAMMAR_CHARS}. Shorten it."
    )


def grammar_text_error(what: str, text: str, limits: GrammarLimits) -> str | None:
    """Why a Lark or GBNF grammar (or a regex) is refused before it is converted (None: it is not)."""
    size = grammar_size_error(what, len(text))
    if size is not None:
        return size
    rules = grammar_rules(text)
    if rules <= limits.max_rules:
        return None
    return (
        f"{what} defines {rules} rules; at most {limits.max_rules} are compiled (--grammar-max-rules). "
        "Simplify the grammar, or raise --grammar-max-rules."
    )


def schema_error(what: str, schema: object, chars: int, limits: GrammarLimits) -> str | None:
    """Why a JSON schema of `chars` characters (compact JSON) is refused before it is converted."""
    size = grammar_size_error(what, chars)
    if size is not None:
        return size
    patterns = schema_patterns(schema)
    if patterns <= limits.max_patterns:
        return None
    return (
        f"{what} has {patterns} patternProperties patterns; at most {limits.max_patterns} are compiled "
        "(--grammar-max-patterns). Use fewer patterns (or properties), or raise --grammar-max-patterns."
    )


def choice_error(what: str, choices: object) -> str | None:
    """Why a `choice` constraint is malformed (None: it is 1 to MAX_CHOICES non-empty strings)."""
    if isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES and all(isinstance(c, str) and c for c in choices):
        return None
    return f"{what} must hold 1 to {MAX_CHOICES} non-empty strings."


def grammar_timeout_error(what: str, seconds: float, limit: str = "--grammar-timeout-s") -> str:
    """A grammar whose conversion, check or compile did not finish within `seconds` (`limit`)."""
    return (
        f"{what} did not compile within {seconds:g} s ({limit}). Simplify it (fewer rules, "
        "alternatives or patternProperties), or raise --grammar-timeout-s."
    )


def compiled_grammar_error(grammar: str, limits: GrammarLimits) -> str | None:
    """The caps again, on a grammar in llguidance's serialized form (a Submit's: the GPU process
    checks what a worker let through before it compiles anything): a Lark text, or a JSON envelope
    of Lark texts and JSON schemas. None where it is within them (or is not readable here: then
    llguidance's own error stands)."""
    what = "the structured-output grammar"
    if not grammar.lstrip().startswith("{"):
        return grammar_text_error(what, grammar, limits)
    try:
        parts = json.loads(grammar).get("grammars") or []
    except (ValueError, AttributeError):
        return None
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict):
            continue
        lark, schema = part.get("lark_grammar"), part.get("json_schema")
        found = (
            grammar_text_error(what, lark, limits)
            if isinstance(lark, str)
            else schema_error(what, schema, 0, limits)
            if schema is not None
            else None
        )
        if found is not None:
            return found
    return None
