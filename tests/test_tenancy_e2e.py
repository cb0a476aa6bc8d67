"""Issue 22's hostile tenant against a real `ringserve serve` on loopback: key A attacks, key B is
the victim. Each test runs one case of `tools/harness/hostile_tenants.py` (the same cases
`python -m ringserve.tools.harness.hostile_check` runs) and fails on any outcome it expects that did not
hold, naming it. Before the fixes every case here had misses (the note of issue 22)."""

from __future__ import annotations

import pytest

from ringserve.tools.harness import hostile_tenants as H
from ringserve.tools.harness.drill import attach_control, find_instance
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(240)


def _server(tiny_model_dir, tmp, **options):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "keys").write_text("key-a\nkey-b\n")
    (tmp / "metrics-keys").write_text("metrics-key\n")
    return ServerProcess(
        tiny_model_dir,
        tmp / "shm",
        workers=1,
        api_keys_file=tmp / "keys",
        metrics_keys_file=tmp / "metrics-keys",
        **options,
    )


def _target(srv: ServerProcess, worker_pid=None) -> H.Target:
    return H.Target(srv.port, str(srv.log_path), "key-a", "key-b", "metrics-key", worker_pid)


@pytest.fixture(scope="module")
def target(tiny_model_dir, tmp_path_factory):
    with _server(tiny_model_dir, tmp_path_factory.mktemp("tenancy")) as srv:
        yield _target(srv)


def _run(case, target: H.Target, **kw) -> None:
    lines: list[str] = []
    checks = H.Checks(printer=lines.append)
    case(target, checks, **kw)
    assert not checks.misses, "\n".join(lines)


def test_response_bomb_is_refused_and_big_answers_do_not_stall_others(target):
    """Item 1: the 24 KB request for a 259 MB answer is a 400 naming --max-response-logprobs;
    a 16 MB answer under it leaves B's stream and /health flowing (before: 4.9 s gaps)."""
    _run(H.big_response, target, tries=1)


def test_keys_and_prompts_never_reach_the_log(target):
    """Item 2: bare-LF requests and a control byte after the key are 400s and log neither."""
    _run(H.log_privacy, target)


def test_one_tenant_cannot_observe_another(target):
    """Item 3: B's guess of A's prompt gets no prefix-cache hits; /metrics needs its own key;
    consecutive request ids are random."""
    _run(H.prefix_privacy, target)


def test_chat_content_cannot_forge_template_markers(target):
    """Item 4: a whole forged system turn inside a user message adds no marker tokens, in
    /tokenize and in what the chat route serves."""
    _run(H.chat_markers, target)


def test_tokenize_is_capped_like_a_prompt(target):
    """Item 6: a 3.9 MB /tokenize prompt is refused by its length at once."""
    _run(H.tokenize_cap, target)


def test_bad_gzip_is_a_400_after_authentication_and_logs_little(target):
    """Item 7: bad gzip: 400 with a key, 401 without; 100 of them write under 4 KB of log."""
    _run(H.bad_gzip, target)


def test_allowed_token_ids_always_hold(target):
    """Item 8: controls that leave no token are a 400; nothing outside allowed_token_ids."""
    _run(H.constraints, target)


def test_expect_long_values_and_the_model_card(target):
    """Item 9: Expect answered before the body; 1 MB values not echoed; no path in /v1/models."""
    _run(H.expect_and_echo, target)


def test_restarted_worker_ends_its_streams_with_an_error_event(tiny_model_dir, tmp_path):
    """Item 1: a worker whose loop stops is restarted and B's open stream ends with a
    worker_restart error event and [DONE] (before: the connection was cut)."""
    with _server(tiny_model_dir, tmp_path, watchdog_timeout_s=2) as srv:
        seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
        try:
            _run(H.last_words, _target(srv, lambda: control.worker_slot(0)["pid"]))
        finally:
            seg.close()
