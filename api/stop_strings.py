"""Stop strings matched on the streamed text across token boundaries.

Text that could still turn into a stop string is held back: with stop "END", a sample that has
produced "...E" emits everything but the "E" until the next token says whether "END" follows. At a
match (the first stop string to complete) the text is cut just before it (OpenAI does not return it;
with vLLM's `include_stop_str_in_output`, just after it) and the sample ends.
"""

from __future__ import annotations


class StopMatcher:
    """Per-sample matcher; `feed(text)` -> (text safe to emit, matched); `matched` is the stop
    string that ended the sample (Anthropic's `stop_sequence`), None before."""

    __slots__ = ("_stops", "_prefixes", "_hold_max", "_held", "_include", "matched")

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        # Every proper prefix of every stop string: the suffixes of the text we must hold back.
        self._prefixes = frozenset(s[:k] for s in stops for k in range(1, len(s)))
        self._hold_max = max((len(s) for s in stops), default=1) - 1
        self._held = ""
        self._include = include
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not text:
            return "", False
        buf = self._held + text
        # The match that completes first wins (ties: the one that starts first), as if the text
        # had arrived one character at a time; only the held text plus the new text can contain a
        # new match, because everything before it was already checked when it was held.
        cut, end, matched = -1, -1, None
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i + len(s) < end or (i + len(s) == end and i < cut)):
                cut, end, matched = i, i + len(s), s
        if cut != -1:
            self._held = ""
            self.matched = matched
            return buf[: end if self._include else cut], True
        hold = self._hold_length(buf)
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], False
        self._held = ""
        return buf, False

    def flush(self) -> str:
        """At the end of a sample the held text is ordinary text."""
        held, self._held = self._held, ""
        return held

    def _hold_length(self, buf: str) -> int:
        prefixes = self._prefixes
        for k in range(min(len(buf), self._hold_max), 0, -1):
            if buf[-k:] in prefixes:
                return k
        return 0
