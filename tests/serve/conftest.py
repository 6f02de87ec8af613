"""Fixtures of the serve tests: the demo engine shared by every server of the session (the tests only read it: each
server builds its own runner and scheduler over it, and the engine's traced functions are reused), and the server
factory."""
from __future__ import annotations

import pytest
from servers import running_server


@pytest.fixture(scope="session")
def demo_engine():
    from strata.engine import Engine
    return Engine.load("demo", max_context=65536)


@pytest.fixture(scope="module")
def serve():
    """The `running_server` factory, for tests that start their own server."""
    return running_server
