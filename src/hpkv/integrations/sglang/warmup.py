"""SGLang's lazily built page hash, made ready while SGLang starts instead of in its first lookup.

SGLang keys its L3 pages by a SHA-256 chain computed by a C++ extension it compiles (g++, ninja,
OpenSSL) into `$TORCH_EXTENSIONS_DIR` on first use, in its prefetch thread: for the first lookup
after a start on a node, container or install that has not built it yet for this SGLang path.
Under SGLang's default `timeout` prefetch policy that lookup, and those queued behind it, then
miss. `ready_page_hash` computes one page's hash in a thread of its own (so that a build that
hangs cannot hold up the start for ever) and waits for it, up to WAIT_S: later calls find the
extension loaded. A build that fails is logged with its fix; SGLang's own call would fail too.
Primitives: SGLang's `get_storage_hash_str`. Knows nothing of HPKV's pool or server.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("hpkv.sglang")

WAIT_S = 300.0  # a first build takes 15-20 s on two idle cores
SLOW_S = 1.0  # a load taking longer than this was (most likely) a build: say so


def ready_page_hash(page_size: int, wait_s: float = WAIT_S) -> bool:
    """Whether SGLang's page hash is ready now (loaded, or built and loaded, within `wait_s`)."""
    done = threading.Event()
    worker = threading.Thread(target=_hash_one_page, args=(page_size, done), name="hpkv-page-hash", daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(wait_s)
    took = time.monotonic() - started
    if worker.is_alive():
        log.warning(
            "SGLang's page hash extension is still loading (building?) after %.0f s; the L3 lookups "
            "before it is ready wait for it and, under the 'timeout' prefetch policy, miss",
            took,
        )
    elif done.is_set() and took > SLOW_S:
        log.info(
            "SGLang's page hash extension took %.1f s to load (it was built); done at start so that "
            "the first L3 lookup can hit",
            took,
        )
    return done.is_set()


def _hash_one_page(page_size: int, done: threading.Event) -> None:
    try:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        get_storage_hash_str([0] * max(1, page_size), None, page_size=max(1, page_size))
    except Exception as exc:
        log.error(
            "SGLang's page hash extension (a C++ extension SGLang compiles on first use) does not "
            "load, so SGLang's L3 lookups fail: install g++, ninja and the OpenSSL headers "
            "(libssl-dev), and make $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) "
            "writable: %s%s",
            exc,
            f" ({exc.__cause__})" if exc.__cause__ else "",
        )
        return
    done.set()
