"""deploy/systemd/: the HPKV server's unit and its example config, read as systemd reads them, and
the server started from them as systemd starts it, in test directories."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from helpers.cli import HPKV_SCRIPT, free_port
from helpers.env import without_hpkv
from helpers.waiting import wait_for
from hpkv.server import protocol
from hpkv.server.autostart import answers

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNIT = DEPLOY / "hpkv-server.service"
CONFIG = DEPLOY / "config.ini"


@dataclass
class Unit:
    """The [Service] settings of a unit file: each key's values, in order."""

    service: dict[str, list[str]] = field(default_factory=dict)

    def one(self, key: str) -> str:
        (value,) = self.service[key]
        return value

    def environment(self) -> dict[str, str]:
        """Environment= lines: each a list of (possibly quoted) NAME=VALUE words."""
        pairs = [word.split("=", 1) for line in self.service.get("Environment", []) for word in shlex.split(line)]
        return {name: value for name, value in pairs}

    def exec_start(self) -> list[str]:
        return shlex.split(self.one("ExecStart"))


def read_unit(path: Path = UNIT) -> Unit:
    unit, section = Unit(), ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service":
            key, _, value = line.partition("=")
            unit.service.setdefault(key.strip(), []).append(value.strip())
    return unit


def read_config(path: Path = CONFIG) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


class UnitServer:
    """The server as the unit starts it: its RuntimeDirectory= and StateDirectory= made with the
    unit's modes (under /dev/shm and `root` in place of /run and /var/lib), the example config
    with those directories (and a small pool, a free metrics port) where the unit names
    /etc/hpkv/config.ini, the unit's Environment=, and its ExecStart= with this venv's hpkv."""

    def __init__(self, root: Path) -> None:
        self.unit = read_unit()
        self.run = Path(tempfile.mkdtemp(prefix="hpkv-unit-", dir="/dev/shm"))  # /run
        self.pool_dir = _made(self.run / self.unit.one("RuntimeDirectory"), self.unit.one("RuntimeDirectoryMode"))
        self.state_dir = _made(root / self.unit.one("StateDirectory"), self.unit.one("StateDirectoryMode"))
        config = read_config()
        where = {
            f"/run/{self.unit.one('RuntimeDirectory')}": str(self.pool_dir),
            f"/var/lib/{self.unit.one('StateDirectory')}": str(self.state_dir),
        }
        # Each path of the example in the unit's directories: the example and the unit agree.
        for key in ("HPKV_SHARE_MEM_FILE_PATH", "HPKV_KV_STORAGE_PATH"):
            config[key] = _moved(config[key], where)
        config.update(HPKV_KV_MEM_POOL_SIZE="64m", HPKV_METRICS_PORT=str(free_port()))
        self.config_path = root / "config.ini"
        self.config_path.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
        self.environment = {**self.unit.environment(), "HPKV_CONFIG_FILE_PATH": str(self.config_path)}
        program, *args = self.unit.exec_start()
        assert Path(program).name == "hpkv", program
        self.command = [str(HPKV_SCRIPT), *args]
        self.log_path = root / "journal.log"
        self.proc: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.pool_dir / protocol.SOCKET_NAME

    def engine_env(self) -> dict[str, str]:
        """What an engine on the node exports: the same config file."""
        return {**without_hpkv(), "HPKV_CONFIG_FILE_PATH": str(self.config_path)}

    def start(self) -> UnitServer:
        with open(self.log_path, "ab") as log:  # systemd: stdio to the journal, working directory /
            self.proc = subprocess.Popen(
                self.command,
                # INVOCATION_ID: systemd sets it for every unit it starts
                env={**_absolute_pythonpath(without_hpkv()), **self.environment, "INVOCATION_ID": "0" * 32},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd="/",
            )
        wait_for(
            lambda: answers(self.socket, timeout_s=0.2) or self.proc.poll() is not None,
            timeout_s=30,
            what="the unit's server to answer",
        )
        assert self.proc.poll() is None, self.log_path.read_text()[-2000:]
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.run, ignore_errors=True)


def _absolute_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """`env` with its PYTHONPATH made absolute: the server runs in /."""
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    return env


def _made(path: Path, mode: str) -> Path:
    path.mkdir(parents=True)
    path.chmod(int(mode, 8))
    return path


def _moved(value: str, where: dict[str, str]) -> str:
    for old, new in where.items():
        if value == old or value.startswith(old + "/"):
            return new + value[len(old) :]
    raise AssertionError(f"{value} is in neither of the unit's directories {list(where)}")
