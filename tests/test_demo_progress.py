"""`hpkv demo`'s waits say what they wait for, how long they took, and keep saying it off a
terminal (`demo/progress.py`)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from hpkv.demo import progress


def test_off_a_terminal_a_wait_says_what_it_waits_for_and_how_long_it_took():
    lines: list[str] = []
    with progress.waiting("starting vLLM", lines.append, Console(file=io.StringIO())):
        pass
    assert lines == ["starting vLLM ...", "starting vLLM: done after 0 s"]


def test_a_long_wait_says_it_is_still_waiting(monkeypatch):
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    lines: list[str] = []
    with progress.waiting("restarting vLLM", lines.append):
        import time

        time.sleep(0.3)
    assert lines[0] == "restarting vLLM ..." and lines[-1] == "restarting vLLM: done after 0 s"
    assert any(line.startswith("  still restarting vLLM (") for line in lines[1:-1])


def test_a_failed_wait_says_so():
    lines: list[str] = []
    with pytest.raises(RuntimeError), progress.waiting("starting vLLM", lines.append):
        raise RuntimeError("vLLM exited")
    assert lines[-1] == "starting vLLM: failed after 0 s"


def test_on_a_terminal_the_spinner_shows_the_elapsed_time():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80)
    lines: list[str] = []
    with progress.waiting("starting vLLM", lines.append, console):
        pass
    assert "starting vLLM ... 0 s" in out.getvalue()
    assert lines == ["starting vLLM: done after 0 s"]


class _Server:
    def __init__(self, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start

    def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("the engine exited")

    def stop(self) -> None:
        self.calls.append("stop")


def test_a_running_server_is_stopped_when_the_walk_fails_and_a_failed_start_says_so():
    lines: list[str] = []
    server = _Server()
    with pytest.raises(ValueError), progress.running(server, "starting SGLang", lines.append) as got:
        assert got is server and server.calls == ["start"]
        raise ValueError("a step failed")
    assert server.calls == ["start", "stop"]
    failing = _Server(fail_start=True)
    with pytest.raises(RuntimeError), progress.running(failing, "restarting SGLang", lines.append):
        pass
    assert lines[-1] == "restarting SGLang: failed after 0 s"
