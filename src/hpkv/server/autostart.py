"""Finding the node's HPKV Server, and starting one when there is none.

Many engine processes may start at once (a scheduler and eight TP workers). Each that finds no
server takes an exclusive `flock` on `<dir>/hpkv.lock`, looks again, and only then starts a
server, so exactly one is started. The lock dies with its holder, so a killed starter leaves
nothing stale; a socket left by a killed server is removed by the next server.

A directory that `hpkv server` serves under a service manager (systemd, which sets
`INVOCATION_ID`: the unit under deploy/) is marked `hpkv.managed` by it, and the mark stays: no
engine auto-starts a server there, also while the managed one restarts (after a crash, or
`systemctl restart`), so none races it with a server of the engine's settings; the engines
recompute until it answers again. Removing the directory (systemd's RuntimeDirectory= on stop) or
the mark ends it. `hpkv server` run by hand marks nothing: nobody would restart it, so once it is
gone the next engine auto-starts one.

The server is started detached (its own session, stdio to `<dir>/server.log`, working directory
/) with the caller's environment, and reads its settings in the caller's working directory, so it
resolves the same configuration, relative paths included; it exits on its own after its last
client leaves.

Nothing in the directory is taken on its name: the directory must be trustworthy
(`pool.directory`), the lock and the log are opened with O_NOFOLLOW|O_NONBLOCK and checked to be
regular files of this uid or root (`safefs`), the socket to be a socket; anything else is a
`ServerUnavailable` naming it and the fix, never a hang: `timeout_s` bounds the whole start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .. import safefs
from ..errors import HpkvError, PoolError
from ..pool import directory as pool_directory
from . import protocol as p

log = logging.getLogger("hpkv.server")

LOG_NAME = "server.log"
MANAGED_NAME = "hpkv.managed"


class ServerUnavailable(HpkvError):
    """No HPKV server could be reached (or started); callers treat everything as a miss."""


def answers(socket_path: Path, timeout_s: float = 1.0) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout_s)
    try:
        probe.connect(str(socket_path))
        return True
    except BlockingIOError:  # EAGAIN: a live server whose accept queue is full (busy, not gone)
        return True
    except OSError:
        return False
    finally:
        probe.close()


_FIX = "or point HPKV_SHARE_MEM_FILE_PATH at a directory only this user can write to"


def check_socket(socket_path: Path) -> bool:
    """Whether the socket is there; ServerUnavailable if something else is (a link planted in its
    place would have this user connect wherever it points). Whose it is, the client learns from
    the peer (SO_PEERCRED) once connected."""
    try:
        return safefs.check_socket(socket_path, None)
    except safefs.UnsafeFile as exc:
        raise ServerUnavailable(
            f"cannot use the HPKV server socket {exc}; remove it (as its owner or root), {_FIX}"
        ) from None


def ensure_server(directory: Path, timeout_s: float = 60.0, trusted_uids: tuple[int, ...] = ()) -> None:
    """Return once a server answers on `<directory>/hpkv.sock`, starting one if needed, within
    `timeout_s`. `trusted_uids`: owners accepted for the directory and the socket besides this
    uid and root (HPKV_SERVER_ALLOW_UIDS); the lock and log must be this uid's or root's."""
    deadline = time.monotonic() + timeout_s
    socket_path = directory / p.SOCKET_NAME
    trusted = safefs.owners(trusted_uids)
    if check_socket(socket_path) and answers(socket_path):
        return
    _refuse_if_managed(directory, trusted)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        pool_directory.check(directory, trusted)
        lock_fd = safefs.open_file(directory / p.LOCK_NAME, os.O_RDWR | os.O_CREAT, safefs.owners())
    except PoolError as exc:
        raise ServerUnavailable(str(exc)) from None
    except safefs.UnsafeFile as exc:
        raise ServerUnavailable(
            f"cannot use {directory} (HPKV_SHARE_MEM_FILE_PATH): its {p.LOCK_NAME} {exc.why}; "
            f"remove it (as its owner or root), {_FIX}"
        ) from None
    except OSError as exc:
        raise ServerUnavailable(
            f"cannot use {directory} (HPKV_SHARE_MEM_FILE_PATH): {exc.strerror}; give uid {os.geteuid()} read, "
            f"write and search permission on it (as root: chown {os.geteuid()} {directory} && chmod 700 "
            f"{directory}), or point HPKV_SHARE_MEM_FILE_PATH at a directory this user owns"
        ) from None
    try:
        _lock(lock_fd, deadline, directory)
        if check_socket(socket_path) and answers(socket_path):
            return  # another process started it while we waited for the lock
        _refuse_if_managed(directory, trusted)  # a managed server claimed it meanwhile
        _start_and_wait(directory, socket_path, deadline)
    finally:
        os.close(lock_fd)  # closing releases the flock


def claim_managed(directory: Path) -> None:
    """Mark `directory` as a managed server's (its pid), where a service manager runs it: called by
    `hpkv server` once it listens, never removed by it (a crash or a restart must leave no window
    for an auto-start). Something else in the marker's place is logged, not fatal: the server
    serves."""
    if not os.environ.get("INVOCATION_ID"):
        return
    path = directory / MANAGED_NAME
    try:
        fd = safefs.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, safefs.owners(), mode=0o644)
    except (safefs.UnsafeFile, OSError) as exc:
        log.warning(
            "cannot mark %s as this managed server's (%s): engines may auto-start a server there while this "
            "one is down; remove what is in the way (as its owner or root)",
            directory,
            exc,
        )
        return
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


def _refuse_if_managed(directory: Path, trusted: frozenset[int]) -> None:
    """ServerUnavailable if a managed server has claimed `directory` (and does not answer now)."""
    path = directory / MANAGED_NAME
    try:
        os.close(safefs.open_file(path, os.O_RDONLY, trusted))
    except FileNotFoundError:
        return
    except safefs.UnsafeFile as exc:
        raise ServerUnavailable(f"cannot use {exc}; remove it (as its owner or root), {_FIX}") from None
    except OSError as exc:  # there, but unreadable: a marker all the same
        if exc.errno != errno.EACCES:
            raise ServerUnavailable(f"cannot read {path}: {exc.strerror}; remove it, {_FIX}") from None
    raise ServerUnavailable(
        f"the managed HPKV server of {directory} does not answer (restarting or stopped; {path} says a "
        "managed server serves this directory): engines never start one in its place and recompute until "
        f"it answers (systemctl status hpkv-server); remove {path} to have engines auto-start one again"
    )


def _lock(fd: int, deadline: float, directory: Path) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ServerUnavailable(
                    f"timed out waiting for another process to start the HPKV server in "
                    f"{directory}; see {directory / LOG_NAME}"
                ) from None
            time.sleep(0.05)


# A launcher starts the server in a new session and exits at once, so the server is adopted by
# init rather than staying a child (and later a zombie) of the engine process that started it.
# The log is opened by the starter, which can say what is wrong with it, and handed down.
_LAUNCHER = (
    "import subprocess, sys\n"
    "log = int(sys.argv[1])\n"
    "proc = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,\n"
    "                        start_new_session=True, close_fds=True, cwd='/')\n"
    "print(proc.pid, flush=True)\n"
)


def _open_log(log_path: Path) -> int:
    """The server log, for appending: a regular file of this uid or root. In a pool directory
    others may write to, a link planted there would have the server's output appended to a file of
    its choosing, and a FIFO would block this open for ever."""
    try:
        return safefs.open_file(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, safefs.owners())
    except safefs.UnsafeFile as exc:
        raise ServerUnavailable(f"cannot open the HPKV server log {exc}; remove it, {_FIX}") from None
    except OSError as exc:
        raise ServerUnavailable(
            f"cannot open the HPKV server log {log_path}: {exc.strerror}; remove it, {_FIX}"
        ) from None


def _start_and_wait(directory: Path, socket_path: Path, deadline: float) -> None:
    log_path = directory / LOG_NAME
    # The launcher is a Python start-up: at least 10 s for it, on a machine slow enough to need it.
    timeout_s = max(10.0, deadline - time.monotonic())
    command = [sys.executable, "-m", "hpkv.server.daemon", "--auto"]
    try:
        # The server runs in /, but reads its settings where its starter runs, so that relative
        # paths (HPKV_CONFIG_FILE_PATH, the directories) mean the same to both.
        command += ["--settings-cwd", os.getcwd()]
    except OSError:
        pass  # the starter's directory is gone: relative paths then resolve from /
    log_fd = _open_log(log_path)
    try:
        launched = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, str(log_fd), *command],
            pass_fds=(log_fd,),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise ServerUnavailable(
            f"starting the HPKV server took over {timeout_s:.0f} s (is the machine overloaded?); see {log_path}"
        ) from None
    except OSError as exc:
        raise ServerUnavailable(f"could not start the HPKV server: {exc}") from None
    finally:
        os.close(log_fd)
    try:
        pid = int(launched.stdout.strip())
    except ValueError:
        raise ServerUnavailable(f"could not start the HPKV server: {launched.stderr.strip()[-500:]}") from None
    while time.monotonic() < deadline:
        if answers(socket_path):
            return
        if not _alive(pid):
            raise ServerUnavailable(f"the HPKV server exited at start: {_tail(log_path)}")
        time.sleep(0.05)
    raise ServerUnavailable(f"the HPKV server did not answer within the start timeout; see {log_path}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tail(path: Path, num_lines: int = 3) -> str:
    try:
        lines = safefs.read_tail(path, safefs.owners()).strip().splitlines()
    except (OSError, safefs.UnsafeFile) as exc:
        return f"(no log: {exc})"
    return " | ".join(lines[-num_lines:])
