"""A node of the cluster tier's tests, as a process of its own: `ClusterNode` drives
`python -m helpers.cluster_node CONFIG_JSON SEGMENT_BYTES`, which holds a `ClusterTier` over
memory of its own (slots of `SIZE` bytes) and answers one JSON line per command:
- write NS KEYS SEED: fill slot i with `payload(SEED, i)`, write them all -> {"taken": n}
- read NS KEYS SEED: read into fresh slots -> {"ok": [...], "wrong": slots that said ok but differ,
  "unsafe": slots whose transfer may still be running}
- contains NS KEYS -> {"found": [...]}
- poke NAME DATA: a raw `put` of bytes under an object name (a damaged or foreign object)
- stats -> the tier's `ClusterStats`; remove NS -> {"removed": n}
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import msgspec

SIZE = 64 * 1024
SLOTS = 64


def payload(seed: int, i: int) -> bytes:
    import numpy as np

    return np.random.default_rng([seed, i]).bytes(SIZE)


def serve(config_json: str, segment_bytes: int) -> None:
    from hpkv.cluster.client import ClusterClient
    from hpkv.cluster.tier import ClusterTier, Read
    from hpkv.config import ClusterConfig

    config = ClusterConfig(**json.loads(config_json))
    memory = mmap.mmap(-1, SIZE * SLOTS)
    tier = ClusterTier(config, memoryview(memory), ClusterClient(config, segment_bytes))
    tier.start()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, ns = cmd["op"], cmd.get("ns", "")
        keys = [bytes.fromhex(k) for k in cmd.get("keys", [])]
        slots = [(key, i * SIZE, SIZE) for i, key in enumerate(keys)]
        if op == "write":
            for i in range(len(keys)):
                memory[i * SIZE : (i + 1) * SIZE] = payload(cmd["seed"], i)
            out: dict = {"taken": tier.write(ns, slots)}
        elif op == "read":
            memory[: len(keys) * SIZE] = b"\xee" * (len(keys) * SIZE)
            reads = tier.read_into(ns, slots)
            ok = [read is Read.HIT for read in reads]
            got = [memory[i * SIZE : (i + 1) * SIZE] for i in range(len(keys))]
            wrong = sum(good and got[i] != payload(cmd["seed"], i) for i, good in enumerate(ok))
            out = {"ok": ok, "wrong": wrong, "unsafe": reads.count(Read.UNSAFE)}
        elif op == "contains":
            out = {"found": tier.contains(ns, keys)}
        elif op == "poke":
            out = {"rc": tier.client._store.put(cmd["name"], bytes.fromhex(cmd["data"]))}
        elif op == "remove":
            out = {"removed": tier.remove(ns or None)}
        else:
            out = msgspec.to_builtins(tier.stats())
        print(json.dumps(out), flush=True)
    tier.close()


class ClusterNode:
    """The process above, driven from a test; `kill()` is a SIGKILL."""

    def __init__(self, config: dict, segment_bytes: int, log_path: Path) -> None:
        env = dict(os.environ)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "helpers.cluster_node", json.dumps(config), str(segment_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                cwd=Path(__file__).resolve().parents[1],
            )
        assert self.ask_line() == {"ready": True}

    def ask_line(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the node exited ({self.proc.poll()})"
        return json.loads(line)

    def ask(self, op: str, **args) -> dict:
        if "keys" in args:
            args["keys"] = [k.hex() for k in args["keys"]]
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.ask_line()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
