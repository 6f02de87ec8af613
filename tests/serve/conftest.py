"""Fixtures of the serve tests: the demo engine shared by a module's servers, and the server factory."""
from __future__ import annotations

import pytest
from servers import running_server


@pytest.fixture(scope="module")
def demo_engine():
    from strata.engine import Engine
    return Engine.load("demo", max_context=65536)


@pytest.fixture(scope="module")
def serve():
    """The `running_server` factory, for tests that start their own server."""
    return running_server
