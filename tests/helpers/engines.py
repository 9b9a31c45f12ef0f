"""The engine tests as a whole: the vLLM skip (tests marked `vllm` where vLLM is not installed),
and a tally of engine starts by module, printed at the end of a session, to see what a session
pays for its engines. The marks are registered in pyproject.toml (`engine`: the test starts a
real engine; `vllm`: it needs vLLM installed), which runs pytest with --strict-markers.

Owns: the skip, the tally, stopping engines side by side. Primitives: `skip_without_vllm`,
`Tally`, `stop_all`.
Must not know: any scenario, model or engine option.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

NO_VLLM = pytest.mark.skip(reason="needs vLLM (pip install ct-hpkv[engines])")


def skip_without_vllm(items) -> None:
    """The one vLLM skip: tests marked `vllm` are skipped where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is not None:
        return
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(NO_VLLM)


def stop_all(engines: Sequence) -> None:
    """Stops engines (anything with `stop()`) side by side: a stop mostly waits for a process
    group to end. Returns once every stop has; the first error, if any, is raised after."""
    if not engines:
        return
    with ThreadPoolExecutor(len(engines)) as pool:
        stops = [pool.submit(engine.stop) for engine in engines]
    for stop in stops:
        stop.result()


@dataclass
class Tally:
    """Engine starts by test module, with the seconds each module spent starting them; starts by a
    test not marked `engine` are named too (`make test-core` would run them)."""

    starts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    unmarked: set[str] = field(default_factory=set)
    _item: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        """Counts every start of this process's vLLM and SGLang servers (`hpkv.demo`'s engine
        processes; a test's own stand-in process group is none)."""
        from hpkv.demo.engine import EngineProcess

        launch = EngineProcess._launch
        tally = self

        def counted(engine, *args, **kwargs):
            if not type(engine).__module__.startswith("hpkv."):
                return launch(engine, *args, **kwargs)
            started = time.monotonic()
            try:
                return launch(engine, *args, **kwargs)
            finally:
                tally.record(time.monotonic() - started)

        EngineProcess._launch = counted  # type: ignore[method-assign]

    def enter(self, item) -> None:
        self._item = item

    def record(self, seconds: float) -> None:
        item = self._item
        module = item.nodeid.split("::")[0] if item is not None else "?"
        with self._lock:
            self.starts[module] += 1
            self.seconds[module] += seconds
            if item is not None and item.get_closest_marker("engine") is None:
                self.unmarked.add(item.nodeid)

    def report(self, write) -> None:
        if not self.starts:
            return
        write(f"engine starts: {sum(self.starts.values())} ({sum(self.seconds.values()):.0f} s starting)")
        for module in sorted(self.starts, key=lambda m: -self.seconds[m]):
            write(f"  {self.starts[module]:3d}  {self.seconds[module]:6.0f} s  {module}")
        for nodeid in sorted(self.unmarked):
            write(f"  started an engine without the engine mark: {nodeid}")
