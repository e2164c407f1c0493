"""Fixtures the unit tests share."""
import pytest

from loopback_env import Env, standard_config


@pytest.fixture
def env():
    """The standard target (loopback_env.standard_config) on the loopback fabric; it may make no internal
    error.  A module with another configuration defines its own `env`."""
    e = Env(standard_config())
    yield e
    assert e.target.internal_errors == 0
    e.close()
