"""The client process behind `helpers.server.Agent`, run as `python -m helpers.agent CONFIG`:
it makes one `hpkv.server.client.Client` from the JSON CONFIG, then runs one JSON command a
line from stdin and answers one JSON line each: the result, or the error it got, always with the
time the call took and the server's pid."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from helpers.keys import ENTRY_BYTES, desc, entry_key, payload


class AgentLoop:
    def __init__(self, config: dict) -> None:
        from hpkv.server.client import Client

        self.client = Client(os.environ["HPKV_SHARE_MEM_FILE_PATH"], **config)
        self.ns: dict[tuple[int, int], str] = {}
        self.leases: list = []
        self.reservations: list = []  # op_reserve's, until op_commit

    def run(self) -> None:
        print(json.dumps({"ready": os.getpid()}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            started = time.monotonic()
            try:
                answer = getattr(self, "op_" + op)(**command)
            except Exception as exc:  # the test wants to see every error a client gets
                answer = {"error": type(exc).__name__, "code": getattr(exc, "code", None), "message": str(exc)}
            answer["elapsed_s"] = time.monotonic() - started
            answer["server_pid"] = self.client.server_pid
            print(json.dumps(answer), flush=True)
        self.client.close()

    def _ns(self, rank: int, entry_bytes: int) -> str:
        return self.ns[(rank, entry_bytes)]

    def op_register(self, rank: int = 0, entry_bytes: int = ENTRY_BYTES) -> dict:
        self.ns[(rank, entry_bytes)] = self.client.register(desc(rank, entry_bytes))
        return {"ns": self.ns[(rank, entry_bytes)]}

    def op_save(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES, start: int = 0) -> dict:
        """Reserve, copy each payload into the pool through this process's mapping, commit."""
        ns = self._ns(rank, entry_bytes)
        keys = [entry_key(prefix, i) for i in range(start, start + n)]
        res = self.client.reserve(ns, keys)
        for i, key in enumerate(keys):
            if res.offsets[i] is not None:
                res.view(i)[:] = payload(key, rank, entry_bytes)
        return {"reserved": sum(o is not None for o in res.offsets), "committed": self.client.commit(res)}

    def op_reserve(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES) -> dict:
        """Reserve and keep the reservations (no commit, no abort)."""
        res = self.client.reserve(self._ns(rank, entry_bytes), [entry_key(prefix, i) for i in range(n)])
        self.reservations.append(res)
        return {"reserved": sum(o is not None for o in res.offsets), "offsets": res.offsets}

    def op_commit(self) -> dict:
        """Commit the reservations op_reserve made (by their ids, as an engine does)."""
        reservations, self.reservations = self.reservations, []
        return {"committed": sum(self.client.commit(res) for res in reservations)}

    def op_lookup(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES) -> dict:
        hit = self.client.lookup(self._ns(rank, entry_bytes), [entry_key(prefix, i) for i in range(n)])
        return {"tiers": [int(t) for t in hit.tiers]}

    def op_load(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES, release: bool = True) -> dict:
        """Lease, wait for promotions, and check every ready entry against its payload."""
        keys = [entry_key(prefix, i) for i in range(n)]
        lease = self.client.lease(self._ns(rank, entry_bytes), keys)
        num_ready = self.client.wait(lease, timeout_s=10.0)
        same = [bytes(lease.view(i)) == payload(keys[i], rank, entry_bytes) for i in range(num_ready or 0)]
        if release:
            self.client.release(lease)
        else:
            self.leases.append(lease)
        return {"num_leased": len(lease.offsets), "num_ready": num_ready, "same": same, "offsets": lease.offsets}

    def op_stats(self) -> dict:
        import msgspec

        return {"stats": msgspec.to_builtins(self.client.stats())}

    def op_write_loop(
        self,
        prefix: str,
        seconds: float,
        rank: int = 0,
        entry_bytes: int = ENTRY_BYTES,
        copy_pause_s: float = 0.002,
        until_commits_on_next_server: int = 0,
    ) -> dict:
        """Write entries one by one, copying each in two halves with a pause between (so a crash
        can find one half-copied), for `seconds` at most, or until that many entries were
        committed on a server other than the first. Records how every call went."""
        from hpkv.server.autostart import ServerUnavailable

        ns = self._ns(rank, entry_bytes)
        half = entry_bytes // 2
        out: dict[str, Any] = {
            "max_call_s": 0.0,
            "unavailable": 0,
            "other_errors": [],
            "reserved_only": [],
            "commit_sent": [],
            "committed": [],
            "server_pids": [],
        }

        def timed(fn, *args):
            started = time.monotonic()
            try:
                return fn(*args)
            finally:
                out["max_call_s"] = max(out["max_call_s"], time.monotonic() - started)

        def on_next_server() -> int:
            return sum(pid != out["server_pids"][0] for _, pid in out["committed"])

        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            if until_commits_on_next_server and out["committed"] and on_next_server() >= until_commits_on_next_server:
                break
            key, i = entry_key(prefix, i), i + 1
            try:
                res = timed(self.client.reserve, ns, [key])
                if res.offsets[0] is None:
                    continue
                data = payload(key, rank, entry_bytes)
                out["reserved_only"].append(i - 1)
                res.view(0)[:half] = data[:half]
                time.sleep(copy_pause_s)
                res.view(0)[half:] = data[half:]
                out["reserved_only"].pop()
                out["commit_sent"].append(i - 1)
                if timed(self.client.commit, res) == 1:
                    out["committed"].append([i - 1, self.client.server_pid])
                    if self.client.server_pid not in out["server_pids"]:
                        out["server_pids"].append(self.client.server_pid)
            except ServerUnavailable:
                out["unavailable"] += 1
                time.sleep(0.01)
            except Exception as exc:
                out["other_errors"].append(f"{type(exc).__name__}: {exc}")
        out["num_keys"] = i
        return out


if __name__ == "__main__":
    AgentLoop(json.loads(sys.argv[1])).run()
