"""Nothing of a grammar runs on the worker's event loop (issue 32): size and complexity caps answer
400 `grammar_too_complex` before any conversion, naming the limit and its flag; what passes them
is converted and checked in a grammar process under `--grammar-timeout-s`, killed past it, while
/health answers at once; a resend is answered from memory, never let through; a grammar that
crashes the compiler costs a grammar process, not the worker; a grammar that admits nothing is a
400 at check time."""

from __future__ import annotations

import asyncio
import time

import pytest

from ringserve.api import grammar_pool
from ringserve.api.grammar_compile import to_grammar
from ringserve.api.grammar_pool import Outcome
from tests.helpers.grammars import gbnf_chain, lark_chain, pattern_schema

pytestmark = pytest.mark.asyncio

HELLO = [{"role": "user", "content": "Hello world"}]


async def _post(served, body: dict) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, **body})
    return resp.status, await resp.json(), time.monotonic() - t0


async def _health_while(served, work) -> tuple[object, list[float]]:
    """Run `work` while /health is asked every 50 ms; (its result, each /health's latency)."""
    task = asyncio.ensure_future(work)
    latencies: list[float] = []
    while not task.done():
        t0 = time.monotonic()
        resp = await served.client.get("/health")
        assert resp.status == 200
        latencies.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)
    return await task, latencies


@pytest.mark.parametrize(
    "body, param, names",
    [
        ({"guided_grammar": gbnf_chain(5000)}, "guided_grammar", "65536"),  # 172 KB: the issue's
        ({"guided_grammar": gbnf_chain(2200)}, "guided_grammar", "--grammar-max-rules"),  # 63 KB
        ({"structured_outputs": {"json": pattern_schema(450)}}, "structured_outputs.json", "--grammar-max-patterns"),
        ({"guided_json": {"type": "array", "items": pattern_schema(65)}}, "guided_json", "--grammar-max-patterns"),
    ],
)
async def test_caps_refuse_before_any_conversion(serve, body, param, names):
    """Over a cap: 400 grammar_too_complex naming the limit, at once, with nothing submitted and
    no grammar process started."""
    served = await serve()
    (status, err, took), latencies = await _health_while(served, _post(served, body))
    assert status == 400 and err["error"]["code"] == "grammar_too_complex", err
    assert err["error"]["param"] == param and names in err["error"]["message"], err
    assert took < 1.0 and max(latencies, default=0.0) < 1.0
    assert served.fake.submits == [] and served.state.grammar.pool.started == 0


async def test_a_slow_grammar_is_killed_at_its_deadline_while_health_answers(serve):
    """Past the caps (raised here), the 2,200-rule GBNF converts for seconds: its grammar process is
    killed at --grammar-timeout-s and the answer is 400 naming the flag; /health answers within 1 s
    all the while; the same grammar sent again is refused from memory, without a second compile."""
    served = await serve(grammar_max_rules=100_000, grammar_timeout_s=1.0)
    body = {"guided_grammar": gbnf_chain(2200)}
    (status, err, took), latencies = await _health_while(served, _post(served, body))
    assert status == 400 and err["error"]["code"] == "grammar_too_complex", err
    assert "--grammar-timeout-s" in err["error"]["message"] and err["error"]["param"] == "guided_grammar"
    assert 1.0 <= took < 4.0, took  # the deadline, plus starting the grammar process (~1 s)
    assert max(latencies) < 1.0, latencies
    pool = served.state.grammar.pool
    assert pool.killed == 1 and pool.started == 1
    status, again, took = await _post(served, body)
    assert status == 400 and again["error"] == err["error"] and took < 0.5
    assert pool.started == 1 and served.fake.submits == []
    # the worker's next constraint gets a fresh grammar process
    status, _, _ = await _post(served, {"guided_regex": "a+"})
    assert status == 200 and pool.started == 2 and len(served.fake.submits) == 1


async def test_a_grammar_that_crashes_the_compiler_costs_only_its_process(serve):
    """A chain of 3,000 Lark rules (caps raised) overflows llguidance's stack: its grammar process
    dies, the request is a 400, and the worker goes on serving constrained requests."""
    served = await serve(grammar_max_rules=100_000)
    status, err, _ = await _post(served, {"guided_grammar": lark_chain(3000)})
    assert status == 400 and err["error"]["code"] == "grammar_too_complex", err
    assert "crashed the grammar compiler" in err["error"]["message"]
    status, _, _ = await _post(served, {"guided_grammar": lark_chain(50)})
    assert status == 200 and len(served.fake.submits) == 1


async def test_cached_grammars_still_pass_the_caps(serve):
    """A grammar that compiled is remembered, yet the caps run on every request: the same schema
    under a server whose caps it passes, then one whose caps it does not."""
    served = await serve(grammar_max_patterns=10)
    body = {"guided_json": pattern_schema(10)}
    for _ in range(2):
        status, _, _ = await _post(served, body)
        assert status == 200
    assert served.state.grammar.pool.started == 1
    served.state.grammar.limits = served.state.grammar.limits.__class__(1000, 9, 5.0)
    status, err, _ = await _post(served, body)
    assert status == 400 and err["error"]["code"] == "grammar_too_complex"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_grammar": 'start: a\na: "x" a\n'}, "guided_grammar"),
        ({"structured_outputs": {"grammar": 'start: "x" b\nb: "y" b\n'}}, "structured_outputs.grammar"),
        ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),
        ({"structured_outputs": {"regex": "ab[^\\x00-\\U0010FFFF]"}}, "structured_outputs.regex"),
    ],
)
async def test_a_grammar_that_admits_nothing_is_400(serve, body, param):
    """Grammars whose language is empty are refused when checked, never served as an empty `stop`."""
    served = await serve()
    status, err, _ = await _post(served, body)
    assert status == 400 and err["error"]["param"] == param, err
    assert err["error"]["code"] == "unsupported_value" and "admits no text" in err["error"]["message"]
    assert served.fake.submits == []


async def test_planted_inline_conversion_stalls_health(serve, monkeypatch):
    """The check above can fail: with the conversion run on the event loop (the bug this issue
    fixed, planted here), /health waits for it. The 1,900-rule chain converts for about 1.6 s here
    (1,500 rules took 0.98 s on a CI machine: too close to the 1 s bound to fail reliably)."""
    served = await serve(grammar_max_rules=100_000, grammar_timeout_s=30.0)

    async def inline(self, job):
        kind, value, ws, closed = job
        return Outcome("ok", grammar=to_grammar(kind, value, ws, closed))

    monkeypatch.setattr(grammar_pool.GrammarPool, "run", inline)
    (status, err, _), latencies = await _health_while(served, _post(served, {"guided_grammar": gbnf_chain(1900)}))
    assert status == 200 and max(latencies) > 1.0, (err, latencies)


async def test_forced_tools_are_measured_before_they_are_copied(serve, tools_template):
    """`tool_choice: required` over 128 tools whose parameters add up past the size cap: 400
    grammar_too_complex naming `tools`, before their schemas are copied and closed."""
    served = await serve(app_kw={"chat_template": tools_template})
    params = {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 40} for j in range(20)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(128)]
    status, err, took = await _post(served, {"tools": tools, "tool_choice": "required"})
    assert status == 400 and err["error"]["code"] == "grammar_too_complex" and err["error"]["param"] == "tools", err
    assert "65536" in err["error"]["message"] and took < 1.0 and served.fake.submits == []
