"""Processes by pid: is one still there, and which one is at the other end of a Unix socket."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_running(pid: int) -> bool:
    """`pid_alive`, and not a zombie (killed, not yet reaped by its parent)."""
    if not pid_alive(pid):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_ids(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected a Unix socket (SO_PEERCRED), as the kernel
    recorded them at connect time: the peer cannot forge them."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid
