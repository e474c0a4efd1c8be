"""The deployment fixture (fixtures/deployment.py) itself: what the tests that start a proxy through it rely on."""
from __future__ import annotations

import socket

from fixtures import deployment
from fixtures.deployment import Workspace


def test_start_proxy_moves_to_another_port_when_its_port_was_taken_meanwhile(tmp_path, monkeypatch):
    """free_port probes a port and the proxy binds it a moment later: another test run on the machine may take it
    in between (two fresh clones' suites did). serve then says so in its own words, and start_proxy tries the next
    port instead of failing the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handed = []
        real = deployment.free_port

        def free_port_taken_first(*args) -> int:
            handed.append(port if not handed else real(*args))
            return handed[-1]

        monkeypatch.setattr(deployment, "free_port", free_port_taken_first)
        ws = Workspace(tmp_path / "ws", "", None)
        proxy = ws.start_proxy()
        try:
            assert handed[0] == port and len(handed) == 2
            assert ws.port == handed[1] != port
            first_log = (tmp_path / "ws" / "proxy-0").glob("*.log")
            said = "".join(path.read_text() for path in first_log)
            assert f"another program already listens on 127.0.0.1:{port}" in said
        finally:
            proxy.stop()
