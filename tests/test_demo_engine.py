"""The engine launcher's ports: two servers started side by side never get the same port, and a
start whose port answers from another process fails instead of talking to that process."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from hpkv.demo.engine import free_port, wait_until_answers


def test_ports_handed_out_in_one_process_are_all_different():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


@pytest.fixture
def http_here():
    """An HTTP server in this process (not the one under test)."""
    server = http.server.HTTPServer(("127.0.0.1", free_port()), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_port_that_answers_from_another_process_is_an_error(http_here, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match=f"another process holds port {http_here}"):
            wait_until_answers(
                sleeper, f"http://127.0.0.1:{http_here}/", 30, "test server", tmp_path / "log", 0.1, port=http_here
            )
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_port_that_answers_from_the_process_started_is_ready(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_answers(server, f"http://127.0.0.1:{port}/", 30, "test server", None, 0.1, port=port)
    finally:
        server.kill()
        server.wait()
