"""What `hpkv demo` is doing while it waits: a spinner with the elapsed time on a terminal, a
line every EVERY_S seconds elsewhere (logs, CI), and how long it took once done.

Primitives: `waiting(what, log, console)` and `running(server, what, log, console)` (context
managers). Must not know engines: a server is anything with `start()` and `stop()`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

EVERY_S = 30.0  # off a terminal: a line this often while waiting


@contextlib.contextmanager
def waiting(what: str, log: Callable[[str], None], console=None) -> Iterator[None]:
    """`what` ("starting vLLM") with its elapsed time until the block ends; then one line saying
    how long it took (or that it failed)."""
    started = time.monotonic()
    done = threading.Event()
    live = console is not None and console.is_terminal
    status: Any = console.status(f"{what} ... 0 s") if live else contextlib.nullcontext()
    if not live:
        log(f"{what} ...")

    def tick() -> None:
        while not done.wait(1.0 if live else EVERY_S):
            elapsed = time.monotonic() - started
            if live:
                status.update(f"{what} ... {elapsed:.0f} s")
            else:
                log(f"  still {what} ({elapsed:.0f} s)")

    ticker = threading.Thread(target=tick, name="hpkv-demo-progress", daemon=True)
    ok = False
    try:
        with status:  # the spinner line is gone before the last line is written
            ticker.start()
            try:
                yield
                ok = True
            finally:
                done.set()
                ticker.join()
    finally:
        log(f"{what}: {'done' if ok else 'failed'} after {time.monotonic() - started:.0f} s")


S = TypeVar("S", bound="_Startable")


class _Startable(Protocol):
    def start(self) -> Any: ...
    def stop(self) -> Any: ...


@contextlib.contextmanager
def running(server: S, what: str, log: Callable[[str], None], console=None) -> Iterator[S]:
    """`server` started (its start shown by `waiting`), stopped when the block ends."""
    with waiting(what, log, console):
        server.start()
    try:
        yield server
    finally:
        server.stop()
