"""Per-tenant counts for /metrics (`tenant_book.py`): the first --metrics-tenants tenants keep a
slot each for the GPU process's life, every later one counts in "other", and the scheduler's
stats count each tenant's requests, prompt and generated tokens, rows and waiting requests."""

from ringserve.gpu_proc.tenant_book import OTHER, TenantBook
from tests.helpers.scheduler_fakes import make_harness, make_request


def test_slots_are_first_come_and_sticky():
    book = TenantBook(2)
    assert [book.slot(t) for t in ("a", "b", "c", "a", "d", "b")] == [0, 1, OTHER, 0, OTHER, 1]
    assert book.names == ["a", "b"]
    assert TenantBook(0).slot("a") == OTHER


def test_the_scheduler_counts_each_tenant_and_the_rest_as_other():
    h = make_harness(num_blocks=256, max_rows=4, metrics_tenants=2)
    for i, tenant in enumerate(["a", "b", "c", "a", "d", "d"]):
        assert h.sched.admit(make_request(i, 10, max_tokens=5, tenant=tenant, ignore_eos=True)).accepted
    h.step()
    stats = h.sched.stats()
    assert h.sched.tenants.names == ["a", "b"]
    assert stats.tenant_requests[:2] == (2, 1) and stats.tenant_requests[OTHER] == 3
    assert stats.tenant_prompt_tokens[0] == 20 and stats.tenant_prompt_tokens[OTHER] == 30
    assert sum(stats.tenant_running) == 4 and sum(stats.tenant_waiting) == 2
    while h.sched.has_work:
        h.step()
    stats = h.sched.stats()
    assert stats.tenant_generation_tokens[:2] == (10, 5) and stats.tenant_generation_tokens[OTHER] == 15
    assert sum(stats.tenant_running) == 0 == sum(stats.tenant_waiting)
