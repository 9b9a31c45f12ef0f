"""Acting as another user (needs root): a forked child that drops to another uid."""

from __future__ import annotations

import json
import os

NOBODY = 65534


def become(uid: int) -> None:
    """This process becomes `uid` (groups and gid too), for good."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def as_other_uid(fn, uid: int = NOBODY):
    """Run `fn` in a forked child that has become `uid`; its JSON-able result, or what it raised
    as {"raised": type name, "message": text, ...the exception's attributes}."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(read_fd)
            become(uid)
            result = fn()
        except BaseException as exc:
            result = {"raised": type(exc).__name__, "message": str(exc), **vars(exc)}
        finally:
            try:
                os.write(write_fd, json.dumps(result, default=str).encode())
            finally:
                os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))
