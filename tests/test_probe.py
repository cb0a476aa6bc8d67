"""The marker probe (ringserve/probe.py): a served model must repeat a code from its prompt; a server
whose model does not (the tiny model's random weights cannot copy) has its GPU process taken out of
service after two failures in a row, and comes back ready."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from ringserve.config import Config, ConfigError
from ringserve.probe import MarkerProbe, probe_once
from tests.helpers.net import http_json
from tests.helpers.server import ServerProcess


class _Completions(BaseHTTPRequestHandler):
    """Answers /v1/completions with `reply(prompt)`; records the Authorization header."""

    reply = staticmethod(lambda prompt: "")
    seen: list[str | None] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(self.headers.get("Authorization"))
        data = json.dumps({"choices": [{"text": type(self).reply(body["prompt"])}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = HTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_a_model_that_repeats_the_code_passes(fake_server):
    """The code the prompt states comes back: ok; the key goes in the Authorization header."""
    _Completions.reply = staticmethod(lambda prompt: " " + prompt.split("code is ")[1].split(".")[0] + ".")
    _Completions.seen = []
    assert probe_once(fake_server, "m", "AB12CD34", "sk-1", 5).ok
    assert _Completions.seen == ["Bearer sk-1"]


def test_a_model_that_writes_anything_else_fails_with_what_it_wrote(fake_server):
    """Another code, or nothing like it, fails and says what came back."""
    _Completions.reply = staticmethod(lambda prompt: " ZZZZ9999, I think")
    result = probe_once(fake_server, "m", "AB12CD34", None, 5)
    assert not result.ok and "ZZZZ9999" in result.detail and "AB12CD34" in result.detail


def test_an_unreachable_server_fails():
    """No server at all is a failure too, not an exception."""
    assert not probe_once("http://127.0.0.1:9", "m", "AB12CD34", None, 2).ok


def test_two_failures_in_a_row_are_needed_to_act(fake_server):
    """One failure does not act; a pass resets the count; two in a row do."""
    verdicts = iter(["AB", "", "", ""])
    _Completions.reply = staticmethod(
        lambda prompt: prompt.split("code is ")[1].split(".")[0] if next(verdicts) else "no"
    )
    probe = MarkerProbe(fake_server, "m", None, interval_s=0.0)
    results = []
    while len(results) < 3:
        r = probe.poll(time.monotonic())
        if r is not None:
            results.append((r.ok, probe.should_act))
        time.sleep(0.01)
    assert results == [(True, False), (False, False), (False, True)]


def test_probe_interval_is_validated():
    with pytest.raises(ConfigError, match="probe_interval_s"):
        Config(probe_interval_s=-2)


@pytest.mark.timeout(300)
def test_a_server_whose_model_fails_the_probe_restarts_its_gpu_process(tiny_model_dir, tmp_path):
    """The tiny model's random weights cannot copy the code: two failed probes restart the GPU
    process (logged with what the model wrote), and the server is ready again afterwards."""
    with ServerProcess(tiny_model_dir, tmp_path / "shm", workers=1, probe_interval_s=0.3) as srv:
        deadline = time.monotonic() + 120
        while "failed the marker probe 2 times in a row" not in srv.log():
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.2)
        assert "the model wrote" in srv.log()
        while http_json(srv.url + "/ready", timeout=5)[0] != 200:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.2)
        assert srv.stop() == 0, srv.log()
