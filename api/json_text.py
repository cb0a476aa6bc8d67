"""JSON that a model wrote, read and written again without loss and without a value that cannot be
sent: what the tool-call parsers use (`chat/tool_parsers.py`) for a call's arguments.

Python's `json` reads `NaN` and `Infinity` (not JSON) and turns `1e999999` into `inf`, which it
writes back as `Infinity`; and it reads `"\\ud800"` into a lone surrogate, which no UTF-8 encoder
(msgspec's, the response's) can write: a 500, or a stream cut with no event. So here numbers stay
the text the model wrote (`Number`), `NaN` / `Infinity` make the text not JSON (a call's
arguments that are not JSON are no call), and a lone surrogate is written back as its `\\u`
escape, exactly as the model wrote it. Nesting too deep to read is not JSON either.
"""

from __future__ import annotations

import json
import re

_SURROGATE = re.compile("[\ud800-\udfff]")


class Number(str):
    """A JSON number as it was written."""


class _Raw(str):
    """JSON text to copy as it is (punctuation between values)."""


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_float=Number, parse_int=Number, parse_constant=_not_json)


def loads(text: str):
    """The value of JSON `text` (numbers as `Number`); ValueError when it is not JSON."""
    try:
        return DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def raw_decode(text: str, pos: int):
    """(value, end) of the JSON value at `pos` of `text`; ValueError when there is none."""
    try:
        return DECODER.raw_decode(text, pos)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def dumps(value) -> str:
    """JSON text of a value `loads` gave (`", "` and `": "` between items, as `json.dumps`), that
    UTF-8 can always encode. Iterative: a value nested as deep as the decoder allows is written."""
    parts: list[str] = []
    todo: list = [value]
    while todo:
        v = todo.pop()
        if type(v) is _Raw or type(v) is Number:
            parts.append(v)
        elif isinstance(v, str):
            parts.append(_string(v))
        elif isinstance(v, dict):
            todo.append(_Raw("}"))
            items = list(v.items())
            for j in range(len(items) - 1, -1, -1):
                key, item = items[j]
                todo += (item, _Raw(_string(key) + ": "))
                if j:
                    todo.append(_Raw(", "))
            todo.append(_Raw("{"))
        elif isinstance(v, list):
            todo.append(_Raw("]"))
            for j in range(len(v) - 1, -1, -1):
                todo.append(v[j])
                if j:
                    todo.append(_Raw(", "))
            todo.append(_Raw("["))
        else:  # True, False, None (and a number not read here: written as json writes it, finite only)
            parts.append(json.dumps(v, allow_nan=False))
    return "".join(parts)


def _string(s: str) -> str:
    text = json.dumps(s, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _SURROGATE.search(text) else text
