"""The vocabulary of `hpkv doctor`: a `Check` with its `Verdict`, and what the node's server said.

Primitives: `Check(name, verdict, detail, fix)`, `Verdict`, `ServerProbe`, `probe_server(directory)`
(asks a running server for its stats, never starts one), `check_server(probe)`.
Must not know: how checks are shown (the CLI renders them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import HpkvError
from ..server import protocol as p
from ..server.autostart import ServerUnavailable
from ..server.client import Client
from ..stats import ServerStats
from ..status import human_duration


class Verdict(str, enum.Enum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class ServerProbe:
    """What the node's server said: its stats, or why there are none."""

    socket: Path
    stats: ServerStats | None = None
    error: HpkvError | None = None


def probe_server(directory: Path, trusted_uids: tuple[int, ...] = ()) -> ServerProbe:
    socket_path = Path(directory) / p.SOCKET_NAME
    if not socket_path.exists():
        return ServerProbe(socket_path)
    try:
        with Client(directory, kind="doctor", autostart=False, trusted_uids=trusted_uids) as client:
            return ServerProbe(socket_path, stats=client.all_stats())  # every namespace: check_namespaces looks at each
    except HpkvError as exc:
        return ServerProbe(socket_path, error=exc)


def check_server(server: ServerProbe) -> Check:
    name = "server"
    if server.stats is not None:
        s = server.stats.server
        mode = "auto-started" if s.auto else "managed"
        detail = (
            f"pid {s.pid}, version {s.version} (protocol {s.protocol}), up "
            f"{human_duration(s.uptime_s)}, {mode}, {len(server.stats.clients) - 1} other clients, "
            f"socket {server.socket}"
        )
        if s.version != __version__:
            return Check(
                name,
                Verdict.WARN,
                f"{detail}; this hpkv is version {__version__}",
                "restart the server after upgrading, so both sides run the same version",
            )
        return Check(name, Verdict.OK, detail)
    if server.error is None:
        return Check(
            name,
            Verdict.INFO,
            f"no server is running on {server.socket}: the first engine process "
            "starts one (auto-start), or run `hpkv server`",
        )
    if isinstance(server.error, ServerUnavailable):
        return Check(
            name,
            Verdict.WARN,
            f"a socket exists at {server.socket} but no server answers on it "
            f"({server.error}): the last server was killed, or it hangs",
            "nothing to do for a killed server: the next one removes the stale socket and pool file; "
            "a hung one must be stopped (kill its pid) first",
        )
    return Check(
        name,
        Verdict.FAIL,
        f"the server at {server.socket} refused this client: {server.error}",
        "follow the server's message above",
    )
