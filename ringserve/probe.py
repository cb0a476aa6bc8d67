"""The marker probe: the served model, end to end, still copies a string it was just shown.

The start-up kernel check compares each kernel with the reference once, on small inputs; what it
cannot see (a kernel that goes wrong at sizes or contexts it did not try, a driver fault after
hours) would show as wrong tokens. So the supervisor sends, every `--probe-interval-s`, a short
greedy completion through the real path (HTTP to a worker, tokenizer, rings, scheduler, model,
kernels, sampler, detokenizer) whose prompt states a fresh random code twice and asks for it again;
a model that serves correctly repeats it (the marker test in tests/test_real_model.py is the same
prompt). Two failures in a row take the replica out of service: the supervisor restarts the GPU
process, so `/ready` answers 503 while it loads again and re-verifies its kernels.

A random-weight model cannot copy anything, so the probe is off for `--load-format dummy`; `auto`
(the default) runs it on CUDA only: on the CPU it would add a request to every test's server.
Plain stdlib (urllib in a thread): the supervisor imports no HTTP client and never blocks on it.
"""

from __future__ import annotations

import json
import random
import string
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PROMPT = "The secret code is {code}. Remember it: {code}. I repeat, the secret code is"
MAX_TOKENS = 12
FAILURES_TO_ACT = 2
AUTO_INTERVAL_S = 60.0


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # what came back (never the API key)


def marker_code(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(8))


def probe_once(url: str, model: str, code: str, key: str | None, timeout_s: float) -> ProbeResult:
    """One greedy completion that must repeat `code`."""
    body = {"model": model, "prompt": PROMPT.format(code=code), "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
    except urllib.error.HTTPError as exc:
        return ProbeResult(False, f"HTTP {exc.code}")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return ProbeResult(False, f"{type(exc).__name__}: {exc}")
    if code in text:
        return ProbeResult(True, "copied")
    return ProbeResult(False, f"asked to repeat {code}, the model wrote {text[:60]!r}")


def first_key(path: str | None) -> str | None:
    """The first key of an API keys file (one key per line, # comments), for the probe's requests."""
    if not path:
        return None
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.split()[0]
    return None


class MarkerProbe:
    """Runs `probe_once` in a thread every `interval_s`; `poll` returns each finished result."""

    def __init__(self, url: str, model: str, key: str | None, interval_s: float, timeout_s: float = 30.0) -> None:
        self.url, self.model, self.key = url, model, key
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.rng = random.Random()
        self.failures = 0  # in a row
        self._next_at: float | None = None
        self._thread: threading.Thread | None = None
        self._result: ProbeResult | None = None

    def reset(self, now: float) -> None:
        """A (re)started GPU process: the first probe one interval after it is ready."""
        self.failures = 0
        self._next_at = now + self.interval_s

    def poll(self, now: float) -> ProbeResult | None:
        """Start a probe when one is due; the result of one that finished since the last call."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
            result, self._result = self._result, None
            if result is not None:
                self.failures = 0 if result.ok else self.failures + 1
            return result
        if self._thread is None and (self._next_at is None or now >= self._next_at):
            self._next_at = now + self.interval_s
            code = marker_code(self.rng)
            self._thread = threading.Thread(target=self._run, args=(code,), name="marker-probe", daemon=True)
            self._thread.start()
        return None

    def _run(self, code: str) -> None:
        self._result = probe_once(self.url, self.model, code, self.key, self.timeout_s)

    @property
    def should_act(self) -> bool:
        return self.failures >= FAILURES_TO_ACT
