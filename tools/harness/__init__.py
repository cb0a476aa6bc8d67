"""Test harnesses, drills and load testers: the hostile-client check, tenants, soak, restart drills, load tests, and the pieces they share (ports, server children, SSE, /metrics, traces)."""
