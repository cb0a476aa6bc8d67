"""Request bodies in, with vLLM's rule for fields we do not know: they are ignored, not refused.

`decode_body(decoder, raw)` -> (body, ignored). The decoder's structs forbid unknown fields, so a
body without any (every body the `openai` client and vLLM's benchmark send) is decoded once, as
before. A body with some is decoded a second time as plain JSON; the fields the structs do not
declare are removed, at any depth the structs describe (the top level, `stream_options`,
`messages[i]`, ...), their paths returned (`x-ringserve-ignored-fields`, and a debug log line),
and what is left is converted to the structs. Fields we declare but cannot honour at the value
sent are the routes' business: a 400 that names them (`protocol.check_neutral`).
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from ringserve.api.errors import bad_request

_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")
_UNKNOWN = "unknown field"
T = TypeVar("T")


def decode_body(decoder: msgspec.json.Decoder[T], raw: bytes) -> tuple[T, tuple[str, ...]]:
    """Decode a JSON request body into `decoder.type`, raising `ApiError(400)` that names the
    offending field; returns the body and the paths of the fields it ignored."""
    try:
        return decoder.decode(raw), ()
    except msgspec.ValidationError as exc:
        if _UNKNOWN not in str(exc):
            raise _invalid(exc) from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise _malformed(exc) from None
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise _malformed(exc) from None  # the typed decode stopped at the unknown field, before this
    ignored: list[str] = []
    _strip(obj, msgspec.inspect.type_info(decoder.type), "", ignored)
    try:
        return msgspec.convert(obj, decoder.type), tuple(ignored)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


def _strip(obj, info, path: str, ignored: list[str]) -> None:
    """Remove from `obj` (plain JSON) every object key the type `info` does not declare."""
    if isinstance(info, msgspec.inspect.UnionType):
        for t in info.types:
            if (
                isinstance(t, msgspec.inspect.StructType)
                and isinstance(obj, dict)
                or isinstance(t, msgspec.inspect.ListType)
                and isinstance(obj, list)
            ):
                _strip(obj, t, path, ignored)
                return
    elif isinstance(info, msgspec.inspect.StructType) and isinstance(obj, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for key in list(obj):
            if key not in fields:
                del obj[key]
                ignored.append(f"{path}.{key}" if path else key)
            else:
                _strip(obj[key], fields[key], f"{path}.{key}" if path else key, ignored)
    elif isinstance(info, msgspec.inspect.ListType) and isinstance(obj, list):
        for i, item in enumerate(obj):
            _strip(item, info.item_type, f"{path}[{i}]", ignored)


def _invalid(exc: msgspec.ValidationError):
    text = str(exc)
    path = _PATH.search(text)
    return bad_request(f"Invalid request body: {text}", path.group(1) if path else None, code="invalid_type")


def _malformed(exc: Exception):
    if isinstance(exc, RecursionError):  # msgspec's error for arrays or objects nested ~1,000 deep
        return bad_request(
            "Request body is nested too deeply; no field of a completion request nests more than two levels.",
            None,
            code="invalid_json",
        )
    if isinstance(exc, UnicodeDecodeError):  # msgspec's error for invalid UTF-8 inside a string
        return bad_request(
            f"Request body is not valid UTF-8 ({exc.reason} at byte {exc.start}); JSON text must be UTF-8.",
            None,
            code="invalid_json",
        )
    return bad_request(f"Request body is not valid JSON: {exc}", None, code="invalid_json")
