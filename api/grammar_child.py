"""A worker's grammar process (`python -m ringserve.api.grammar_child`, started by
`grammar_pool.py`): converts and checks structured-output constraints (`grammar_compile.py`) one
at a time, so that the worker's event loop never runs them and a constraint that takes too long
(or crashes the compiler) costs only this process, which the worker kills and replaces.

Frames on stdin and stdout: a little-endian u32 length, then msgpack. First `{"tokenizer":
tokenizer.json text, "vocab": n}`, answered `["ready"]`; then one job per frame, `[kind, value,
whitespace, closed]` (a JSON schema as its JSON text), answered `["ok", grammar]` or
`["refused", code, message]`. It dies with its worker (PR_SET_PDEATHSIG) and exits at EOF.
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys
from typing import BinaryIO

import msgspec

_HEADER = struct.Struct("<I")
PR_SET_PDEATHSIG = 1


def read_frame(stream: BinaryIO) -> object | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    return msgspec.msgpack.decode(stream.read(size))


def frame(value: object) -> bytes:
    body = msgspec.msgpack.encode(value)
    return _HEADER.pack(len(body)) + body


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the EOF on stdin still ends it
        pass


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    import llguidance

    from ringserve.api.grammar_compile import Refused, check, to_grammar

    init = read_frame(inp)
    if not isinstance(init, dict):
        return
    tokenizer = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["vocab"])
    out.write(frame(["ready"]))
    out.flush()
    while (job := read_frame(inp)) is not None:
        kind, value, whitespace, closed = job if isinstance(job, list) else ("", None, None, False)
        try:
            grammar = to_grammar(kind, value, whitespace, closed)
            check(grammar, tokenizer)
            answer = ["ok", grammar]
        except Refused as exc:
            answer = ["refused", exc.code, exc.message]
        except Exception as exc:  # llguidance refusing a value in a way of its own
            answer = ["refused", "unsupported_value", f"cannot be compiled: {type(exc).__name__}: {exc}"]
        out.write(frame(answer))
        out.flush()


def main() -> int:
    _die_with_parent()
    # NOTE: the frames own the original stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
