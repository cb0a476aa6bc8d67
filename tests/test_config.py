"""Config: defaults from docs/design.md, environment overrides, clear errors."""

import pytest

from ringserve.config import Config, ConfigError


def test_defaults_are_the_seeds_numbers():
    """Block 16, 32 rows, 256-token prefill budget, 8,192 context, 2 s queue limit; the output
    token's weight is the cost model's (0); steps held to 1 s / (4 + 2) / (4/3) = 125 ms, so a light
    tenant's first token comes within 1 s."""
    c = Config()
    assert (c.block_size, c.max_rows, c.prefill_budget, c.context_limit) == (16, 32, 256, 8192)
    assert (c.queue_limit_s, c.key_row_cap, c.output_token_weight) == (2.0, 8, 0.0)
    assert c.step_target == 125.0 and Config(step_target_ms=40).step_target == 40
    assert Config(fair_preempt_steps=2).step_target == 187.5


def test_environment_then_overrides():
    """RINGSERVE_* variables apply, explicit overrides win."""
    c = Config.from_env({"RINGSERVE_MAX_ROWS": "48", "RINGSERVE_PORT": "9000"}, port=9100)
    assert c.max_rows == 48 and c.port == 9100


def test_bad_values_name_the_field():
    """A wrong value raises ConfigError naming the setting."""
    with pytest.raises(ConfigError, match="max_rows"):
        Config(max_rows=0)
    with pytest.raises(ConfigError, match="RINGSERVE_PORT"):
        Config.from_env({"RINGSERVE_PORT": "eighty"})


def test_json_round_trip():
    """What the supervisor hands its children is the same Config."""
    c = Config(max_rows=7, model="/m", queue_limit_s=1.5)
    assert Config.from_json(c.to_json()) == c


def test_boolean_settings():
    """on/off switches parse from the environment; nonsense is refused."""
    assert Config.from_env({"RINGSERVE_PREFIX_CACHING": "off"}).prefix_caching is False
    assert Config.from_env({"RINGSERVE_PREFIX_CACHING": "ON"}).prefix_caching is True
    with pytest.raises(ConfigError, match="RINGSERVE_PREFIX_CACHING"):
        Config.from_env({"RINGSERVE_PREFIX_CACHING": "maybe"})
