"""Write-through processes, the server's side: entry files written by child processes of their
own (`writer_child`), started, fed batches of jobs, replaced when they die.

Why processes: the checksum and the copy would otherwise compete for the server's GIL with its
request handlers, and could not run below the engines (niceness `HPKV_WRITE_NICE`). A process
gets the pool as a descriptor (`pass_fds`, never by name); the protocol is `writer_child`'s.

Primitives: `WriterPool(pool_fd, num_processes, nice)` (the descriptor stays the caller's, open
while the pool lives): `write_many(jobs, fsync) -> [OSError | None]` (jobs: `Job`s, done by one
process in one round trip; the caller holds their slots until it returns), `write` (one),
`pids()`, `stats()`, `close()`, `kill()`; `WriterUnavailable` when no writer process can be
started (the caller then writes in process).
Must not know: the index, capacity, eviction (the storage tier keeps them).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, NamedTuple

from ..errors import HpkvError
from ..stats import WriterStats
from . import format as fmt
from .fileio import FileTarget, remove_temp
from .writer_child import _OK_LINE, HELLO, PROTOCOL_VERSION

log = logging.getLogger(__name__)


class WriterUnavailable(HpkvError):
    """No writer process could be started; write in process instead."""


class Unanswered(OSError):
    """A job the process did not answer: it died or was stopped first (whether it wrote the file
    is not known)."""


class Job(NamedTuple):
    """One entry file to write from the pool slot at `offset`, in file format `version` (the
    aligned one is written with O_DIRECT)."""

    ns: str
    key: bytes
    offset: int
    length: int
    target: FileTarget
    version: int = fmt.VERSION

    def message(self, fsync: str) -> dict:
        t = self.target
        return {
            "ns": self.ns,
            "key": self.key.hex(),
            "offset": self.offset,
            "length": self.length,
            "final": t.final,
            "tmp": t.tmp,
            "directory": t.directory,
            "mkdir": t.mkdir,
            "root": t.root,
            "root_id": t.root_id,
            "fsync": fsync,
            "format": self.version,
        }


class WriterProcess:
    """One child process; one batch of jobs at a time."""

    def __init__(self, pool_fd: int, nice: int) -> None:
        src_root = str(Path(__file__).resolve().parents[2])  # so the child imports this hpkv
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hpkv.storage.writer_child", str(pool_fd), str(nice)],
                pass_fds=(pool_fd,),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            raise WriterUnavailable(f"cannot start a write-through process: {exc}") from None
        hello = self._read_reply()
        if hello.get("hello") != HELLO or hello.get("version") != PROTOCOL_VERSION:
            self.kill()
            raise WriterUnavailable(
                f"the write-through process answered {hello!r}, expected protocol {PROTOCOL_VERSION} "
                f"(is another hpkv installed for {sys.executable}?)"
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def _stdin(self) -> IO[bytes]:
        assert self.proc.stdin is not None  # started with stdin=PIPE
        return self.proc.stdin

    @property
    def _stdout(self) -> IO[bytes]:
        assert self.proc.stdout is not None  # started with stdout=PIPE
        return self.proc.stdout

    def write_many(self, jobs: list[dict]) -> list[OSError | None]:
        """Send the jobs as one batch; their errors, in order (`Unanswered` for each one a process
        that died or was stopped did not answer)."""
        try:
            self._stdin.write(json.dumps(jobs).encode() + b"\n")
            self._stdin.flush()
        except (OSError, ValueError):  # it died, or the pool closed it (ValueError: closed pipe)
            pass  # the replies say so
        return [self._error(self._next_reply()) for _ in jobs]

    def _next_reply(self) -> dict:
        try:
            return self._read_reply()
        except (OSError, ValueError):  # stopped meanwhile (ValueError: closed pipe)
            return {"errno": errno.EIO, "error": f"the write-through process {self.proc.pid} is gone", "gone": True}

    def _error(self, reply: dict) -> OSError | None:
        if reply.get("ok") is True:
            return None
        if not isinstance(reply.get("errno"), int):  # what answered was not the writer's reply
            self._out_of_step(repr(reply)[:80])
            reply = {"errno": errno.EPROTO, "error": f"the write-through process said {reply!r:.80}"}
        error = Unanswered if reply.get("gone") else OSError
        return error(reply["errno"], reply.get("error", "write-through process failed"))

    def _read_reply(self) -> dict:
        line = self._stdout.readline()  # blocks without the GIL
        if line == _OK_LINE:  # nearly every reply: no parse
            return {"ok": True}
        if not line:
            code = self.proc.wait()
            return {
                "errno": errno.EIO,
                "error": f"the write-through process {self.proc.pid} exited ({code})",
                "gone": True,
            }
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self._out_of_step(repr(line[:80]))
            return {"errno": errno.EPROTO, "error": f"the write-through process said {line[:80]!r}"}
        return reply

    def _out_of_step(self, what: str) -> None:
        """A line that is not a reply (something the child printed): its real reply may still
        come, for this job or the next, and it may still be reading this job's slot, which the
        caller frees once we return. Only a process that is gone reads nothing: kill it."""
        log.warning("write-through process %d wrote %s, not a reply; stopping it", self.proc.pid, what)
        self.kill()

    def close(self, timeout_s: float = 10.0) -> None:
        """End of input: it finishes the job in hand and exits."""
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._stdout.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self._stdin, self._stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WriterPool:
    """Up to `num_processes` writers, started on first use and restarted when one dies (the jobs
    it did not answer go once to its successor). One that cannot start raises WriterUnavailable,
    and so does every place without a process for the next RETRY_S seconds (no new attempt, one
    warning per failed attempt); the processes already running go on writing."""

    RETRY_S = 60.0

    def __init__(self, pool_fd: int, num_processes: int, nice: int) -> None:
        self.pool_fd = pool_fd
        self.nice = nice
        self._idle: queue.SimpleQueue[WriterProcess | None] = queue.SimpleQueue()
        for _ in range(num_processes):
            self._idle.put(None)  # a free place, its process not started yet
        self._lock = threading.Lock()
        self._procs: set[WriterProcess] = set()
        self._closed = False
        self._retry_at = 0.0
        self._unavailable: str | None = None  # why the last start failed, until one succeeds
        self.num_started = 0
        self.num_died = 0
        self.num_start_failures = 0

    def write(
        self, ns: str, key: bytes, offset: int, length: int, target: FileTarget, fsync: str, version: int = fmt.VERSION
    ) -> OSError | None:
        """One job (`write_many`)."""
        return self.write_many([Job(ns, key, offset, length, target, version)], fsync)[0]

    def write_many(self, jobs: list[Job], fsync: str) -> list[OSError | None]:
        """Write the jobs' entry files, in one batch to one process; their errors, in order. The
        jobs a process that died did not answer go once more to another. Raises
        WriterUnavailable when no writer can be started (the files are in place or not)."""
        messages = [job.message(fsync) for job in jobs]
        proc = self._idle.get()
        try:
            proc = self._ready(proc)
            errors = proc.write_many(messages)
            if not proc.alive():
                again = self._gone(proc, next((e for e in errors if e is not None), None))
                proc = None
                self._remove_temps(jobs, errors)
                todo = [i for i, e in enumerate(errors) if isinstance(e, Unanswered)]
                if again and todo:
                    proc = self._ready(None)
                    for i, error in zip(todo, proc.write_many([messages[i] for i in todo]), strict=True):
                        errors[i] = error
                    if not proc.alive():
                        self._gone(proc, next((errors[i] for i in todo if errors[i] is not None), None))
                        proc = None
                    self._remove_temps([jobs[i] for i in todo], [errors[i] for i in todo])
            else:
                self._remove_temps(jobs, errors)
            return errors
        finally:
            self._idle.put(proc)

    @staticmethod
    def _remove_temps(jobs: list[Job], errors: list[OSError | None]) -> None:
        for job, error in zip(jobs, errors, strict=True):
            if error is not None and error.errno != errno.EEXIST:
                # A dead process's temporary (named with this server's pid: no scan removes it
                # while the server lives). Not after EEXIST: that file is somebody else's.
                remove_temp(job.target)

    def _gone(self, proc: WriterProcess, error: OSError | None) -> bool:
        """Forget a process that died (or was killed) during a batch; whether another may take
        its jobs (not once the pool is killed or closed)."""
        with self._lock:
            killed = self._closed and proc not in self._procs
            if not killed:
                self.num_died += 1
                self._procs.discard(proc)
        if not killed:
            log.warning("write-through process %d died: %s; starting another", proc.pid, error)
        proc.close(timeout_s=1.0)
        return not killed

    def _ready(self, proc: WriterProcess | None) -> WriterProcess:
        if proc is not None:
            return proc
        if self._closed:
            raise WriterUnavailable("the write-through processes are closed")
        with self._lock:
            if time.monotonic() < self._retry_at:
                raise WriterUnavailable(self._unavailable or "no write-through process")
        try:
            proc = WriterProcess(self.pool_fd, self.nice)
        except WriterUnavailable as exc:
            with self._lock:
                self.num_start_failures += 1
                self._unavailable = str(exc)
                self._retry_at = time.monotonic() + self.RETRY_S
            log.warning(
                "%s; write-throughs without a process run in the server process, and another start is tried in %.0f s",
                exc,
                self.RETRY_S,
            )
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._procs.add(proc)
                self.num_started += 1
                self._unavailable = None
        if closed:  # killed or closed while it started
            proc.kill()
            raise WriterUnavailable("the write-through processes are closed")
        return proc

    def pids(self) -> list[int]:
        with self._lock:
            return sorted(p.pid for p in self._procs)

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(
                processes=len(self._procs),
                started=self.num_started,
                died=self.num_died,
                start_failures=self.num_start_failures,
                unavailable=self._unavailable,
                nice=self.nice,
            )

    def kill(self) -> None:
        """Kill every process now: a job in hand fails (EIO), and no other starts."""
        with self._lock:
            self._closed = True
            procs, self._procs = list(self._procs), set()
        for proc in procs:
            proc.proc.kill()

    def close(self) -> None:
        """Callers must have finished their writes."""
        with self._lock:
            self._closed = True
            procs, self._procs = list(self._procs), set()
        for proc in procs:
            proc.close()
