"""A worker's refusals at once (`api/refusals.py`): from the GPU process's table of tenants near
the queue limit and the prices it gave each tenant's recent requests."""

from ringserve.api.refusals import Refusals


class _Table:
    """The control block's region: a sequence and (limit ms, tenant -> (ms ahead, Retry-After s))."""

    def __init__(self) -> None:
        self.seq, self.limit, self.near = 0, 2000.0, {}
        self.reads = 0

    def publish(self, near) -> None:
        self.seq += 2
        self.near = near

    def read(self):
        self.reads += 1
        return self.seq, self.limit, dict(self.near)


def _refusals(table: _Table) -> Refusals:
    return Refusals(lambda: table.seq, table.read)


def test_a_tenant_past_the_limit_is_refused_whatever_it_sends():
    t = _Table()
    r = _refusals(t)
    assert r.retry_after("a") is None
    t.publish({"a": (2300, 4)})
    assert r.retry_after("a") == 4 and r.retry_after("b") is None


def test_a_tenant_near_the_limit_is_refused_when_its_cheapest_recent_price_would_pass_it():
    """1.85 s ahead: a tenant whose recent requests cost 0.2 s or more is refused (the GPU would
    refuse them); one with a 0.1 s request among its last prices, or with no price yet, is not."""
    t = _Table()
    r = _refusals(t)
    t.publish({"a": (1850, 2), "b": (1850, 2), "c": (1850, 2)})
    for ms in (250.0, 200.0, 300.0):
        r.note_price("a", ms)
    for ms in (250.0, 100.0):
        r.note_price("b", ms)
    assert (r.retry_after("a"), r.retry_after("b"), r.retry_after("c")) == (2, None, None)


def test_the_table_is_read_again_only_when_it_changed():
    t = _Table()
    r = _refusals(t)
    for _ in range(100):
        r.retry_after("a")
    assert t.reads == 1
    t.publish({})
    r.retry_after("a")
    assert t.reads == 2
