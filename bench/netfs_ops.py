"""Per-operation metadata costs of a storage root shared by nodes, as one node's client sees them,
on the network file systems that run here (GlusterFS with default client caching, MooseFS), each
mounted twice (node A's mount and node B's), and on a local directory for reference.

    python -m bench.netfs_ops [--files 500] [--trials 5] [--walk-files 2000] [--out costs.json] [--json]  # as root

Per file system, in one directory of `--files` small files (4 KiB, as deep in the tree as HPKV's
`<ns>/<ab>/<cd>/` leaves; a leaf holds ~1,500 files at 100 million files):
- `create_fsync_rename`: A creates a temporary, writes 4 KiB, fsyncs it, renames it into place;
- `rename`: A renames a file to a new name (what a lease renewal by rename costs);
- `stat_hit`, `stat_hit_warm`: B stats a file A wrote, by name, first time and again;
- `stat_miss`, `stat_miss_repeat`: B stats a name that does not exist, first time and again
  (a client's negative entry cache answers the repeat, where it has one);
- `open_read`: B opens and reads 4 KiB of a file it has not read before;
- `readdir_entry`: B lists the directory (`scandir`, names only), per entry;
- `walk_entry`: B lists it and `lstat`s each entry (what a walk of the root costs per file);
- `dir_list`: B opens and lists a leaf directory A made (one file in it), per directory (what a
  walk costs per leaf directory: 65,536 of them per namespace once it holds a million files);
- `unlink`: B unlinks a file A wrote.
Then the cache lags, `--trials` each, B polling every 0.5 ms from before A acts: a new name
renamed into place on A until B's `stat` finds it (`lag_new`), a file A replaced by rename until
B reads the new content (`lag_replace`), an unlink on A until B's `stat` misses (`lag_unlink`), a
`utime` on A until B's `stat` shows it (`lag_mtime`).
Then, with `--walk-files` N, the model's check: N files written through A into HPKV's tree, spread
over the leaf directories as keys fall (`spread`: about one file a directory) and packed into 16
(`packed`), walked through B by the tier's own walk (`hpkv.storage.scan.walk`), first time:
`bench.shared_root_sim` predicts these from the costs above.
Every figure is the median and p90 in microseconds (lags: median and max). Run it under
`flock /tmp/hpkv-engine.lock` on a shared machine; `--out` writes the JSON that
`bench.shared_root_sim --costs` reads. Progress to stderr, the table (or --json) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness.netfs import local_and_shared
from bench.harness.report import log
from hpkv.stats import StorageCounters
from hpkv.storage import scan, tree

SMALL = 4096
POLL_S = 0.0005
LAG_TIMEOUT_S = 5.0
OPS = (
    "create_fsync_rename",
    "rename",
    "stat_hit",
    "stat_hit_warm",
    "stat_miss",
    "stat_miss_repeat",
    "open_read",
    "readdir_entry",
    "walk_entry",
    "dir_list",
    "unlink",
)
LAGS = ("lag_new", "lag_replace", "lag_unlink", "lag_mtime")


def _summary(times_s: list[float]) -> dict[str, float]:
    ordered = sorted(times_s)
    return {
        "median": statistics.median(ordered) * 1e6,
        "p90": ordered[max(0, int(len(ordered) * 0.9) - 1)] * 1e6,
        "max": ordered[-1] * 1e6,
        "n": len(ordered),
    }


def _each(fn: Callable[[str], object], names: list[str]) -> list[float]:
    out = []
    for name in names:
        started = time.perf_counter()
        fn(name)
        out.append(time.perf_counter() - started)
    return out


def _write(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, directory / name)


def _stat_missing(path: Path) -> None:
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    raise RuntimeError(f"{path} exists")


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, SMALL)
    finally:
        os.close(fd)


def _list_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as it:
            list(it)
    finally:
        os.close(fd)


def ops(a: Path, b: Path, num: int) -> dict[str, dict[str, float]]:
    """The per-operation costs with `num` files in one leaf directory (written through A), and
    `num` // 3 sibling directories of one file each."""
    data = secrets.token_bytes(SMALL)
    dirs = [f"d{i:04x}" for i in range(num // 3)]
    for d in dirs:
        (a.parent / d).mkdir()
        (a.parent / d / "x.kv").write_bytes(b"x")
    names = [f"{secrets.token_hex(16)}.kv" for _ in range(num)]
    third = num // 3
    out = {"create_fsync_rename": _summary(_each(lambda n: _write(a, n, data), names))}
    renamed = [f"r{n}" for n in names[:third]]
    out["rename"] = _summary(_each(lambda n: os.rename(a / n, a / f"r{n}"), names[:third]))
    for old, new in zip(names[:third], renamed):
        os.rename(a / new, a / old)
    time.sleep(1.5)  # past the attribute and entry caches' lag, as a lookup long after the write
    hit, read, rest = names[:third], names[third : 2 * third], names[2 * third :]
    out["stat_hit"] = _summary(_each(lambda n: os.stat(b / n), hit))
    out["stat_hit_warm"] = _summary(_each(lambda n: os.stat(b / n), hit))
    absent = [f"{secrets.token_hex(16)}.kv" for _ in range(third)]
    out["stat_miss"] = _summary(_each(lambda n: _stat_missing(b / n), absent))
    out["stat_miss_repeat"] = _summary(_each(lambda n: _stat_missing(b / n), absent))
    out["open_read"] = _summary(_each(lambda n: _read(b / n), read))
    listed, walked = [], []
    for _ in range(3):
        started = time.perf_counter()
        with os.scandir(b) as it:
            entries = list(it)
        listed.append((time.perf_counter() - started) / len(entries))
        started = time.perf_counter()
        with os.scandir(b) as it:
            for entry in it:
                entry.stat(follow_symlinks=False)
        walked.append((time.perf_counter() - started) / len(entries))
    out["readdir_entry"], out["walk_entry"] = _summary(listed), _summary(walked)
    out["dir_list"] = _summary(_each(lambda d: _list_dir(b.parent / d), dirs))
    out["unlink"] = _summary(_each(lambda n: os.unlink(b / n), rest))
    return out


def _poll(done: Callable[[], bool]) -> float:
    """Seconds until `done()` (polled every POLL_S), at most LAG_TIMEOUT_S."""
    started = time.perf_counter()
    while not done():
        if time.perf_counter() - started > LAG_TIMEOUT_S:
            break
        time.sleep(POLL_S)
    return time.perf_counter() - started


def _exists(path: Path) -> bool:
    try:
        os.stat(path)
        return True
    except OSError:  # ENOENT, or ESTALE in a rename race: not there yet
        return False


def _reads(path: Path, data: bytes) -> bool:
    try:
        return _read(path) == data
    except OSError:
        return False


def _mtime_is(path: Path, mtime: int) -> bool:
    try:
        return int(os.stat(path).st_mtime) == mtime
    except OSError:
        return False


def lags(a: Path, b: Path, trials: int) -> dict[str, dict[str, float]]:
    """How long B takes to see what A did: each lag from the end of A's call to B's observation."""
    out: dict[str, list[float]] = {lag: [] for lag in LAGS}
    for _ in range(trials):
        _lag_trial(a, b, f"{secrets.token_hex(16)}.kv", out)
    return {lag: _summary(times) for lag, times in out.items()}


def _lag_trial(a: Path, b: Path, name: str, out: dict[str, list[float]]) -> None:
    _exists(b / name)  # B looked before: a lookup that missed, then the write
    _write(a, name, b"old")
    out["lag_new"].append(_poll(lambda: _exists(b / name)))
    _read(b / name)  # B holds the old version in its caches
    new = secrets.token_bytes(16)
    _write(a, f"n{name}", new)
    os.rename(a / f"n{name}", a / name)
    out["lag_replace"].append(_poll(lambda: _reads(b / name, new)))
    mtime = int(time.time()) - 3600 - secrets.randbelow(3600)
    os.utime(a / name, (mtime, mtime))
    out["lag_mtime"].append(_poll(lambda: _mtime_is(b / name, mtime)))
    os.unlink(a / name)
    out["lag_unlink"].append(_poll(lambda: not _exists(b / name)))


def _fill(root: Path, keys: list[bytes], data: bytes) -> int:
    """Files of `keys` in HPKV's layout under `root` (one namespace); the leaf directories made."""
    ns, dirs = "ab" * 16, set()
    for key in keys:
        name = key.hex()
        leaf = root / ns / name[:2] / name[2:4]
        if leaf not in dirs:
            leaf.mkdir(parents=True, exist_ok=True)
            dirs.add(leaf)
        (leaf / f"{name}.kv").write_bytes(data)
    return len(dirs)


def _tier_walk(root: Path) -> tuple[float, int]:
    """(seconds, files found) of the storage tier's own walk of `root`."""
    held = tree.Root(str(root))
    try:
        started = time.perf_counter()
        found = scan.walk(held, "bench", lambda ns, key: key, lambda size: size, StorageCounters())
        return time.perf_counter() - started, len(found.keys)
    finally:
        held.close()


def walks(a_root: Path, b_root: Path, num: int) -> list[dict[str, float]]:
    """The tier's walk through B of `num` files A wrote, spread and packed (see the docstring)."""
    out = []
    data = secrets.token_bytes(SMALL)
    prefixes = [secrets.token_bytes(2) for _ in range(16)]
    for layout in ("spread", "packed"):
        tag = secrets.token_hex(4)
        keys = [secrets.token_bytes(16) for _ in range(num)]
        if layout == "packed":
            keys = [prefixes[i % 16] + k[2:] for i, k in enumerate(keys)]
        try:
            dirs = _fill(a_root / f"walk-{tag}", keys, data)
            time.sleep(1.5)
            seconds, found = _tier_walk(b_root / f"walk-{tag}")
        finally:
            shutil.rmtree(a_root / f"walk-{tag}", ignore_errors=True)
        out.append({"layout": layout, "files": found, "dirs": dirs, "seconds": seconds})
        log(f"  walk, {layout}: {found} files in {dirs} leaf directories, {seconds:.2f} s")
    return out


def measure(name: str, a_root: Path, b_root: Path, num: int, trials: int) -> dict[str, dict[str, float]]:
    tag = secrets.token_hex(4)
    leaf = Path(f"ops-{tag}/cd/ab")
    (a_root / leaf).mkdir(parents=True)
    try:
        time.sleep(1.5)
        result = ops(a_root / leaf, b_root / leaf, num)
        result.update(lags(a_root / leaf, b_root / leaf, trials))
    finally:
        shutil.rmtree(a_root / f"ops-{tag}", ignore_errors=True)
    log(f"{name}: " + ", ".join(f"{op} {result[op]['median']:.0f} us" for op in (*OPS, *LAGS)))
    return result


Results = dict[str, dict[str, dict[str, float]]]


def run(num: int, trials: int, walk_files: int) -> tuple[Results, dict[str, list[dict[str, float]]]]:
    """(per-operation costs, walks) per file system."""
    results: Results = {}
    checks: dict[str, list[dict[str, float]]] = {}
    for name, a_root, b_root in local_and_shared("hpkv-bench-netfs-ops-"):
        results[name] = measure(name, a_root, b_root, num, trials)
        if walk_files:
            checks[name] = walks(a_root, b_root, walk_files)
    return results, checks


def table(results: Results) -> str:
    names = list(results)
    lines = [
        "| operation (µs: median / p90; lags: median / max) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for op in OPS:
        cells = [f"{results[n][op]['median']:,.1f} / {results[n][op]['p90']:,.1f}" for n in names]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    for lag in LAGS:
        cells = [f"{results[n][lag]['median']:,.0f} / {results[n][lag]['max']:,.0f}" for n in names]
        lines.append(f"| {lag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def walks_table(checks: dict[str, list[dict[str, float]]]) -> str:
    lines = [
        f"walk through B, {c['layout']}: {name} {c['files']:.0f} files in {c['dirs']:.0f} leaf directories, "
        f"{c['seconds']:.2f} s"
        for name, rows in checks.items()
        for c in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=500, help="small files in the leaf directory")
    parser.add_argument("--trials", type=int, default=5, help="trials of each cache lag")
    parser.add_argument("--walk-files", type=int, default=2000, help="files per walk check (0: none)")
    parser.add_argument("--out", type=Path, help="write the JSON here (for bench.shared_root_sim --costs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results, checks = run(max(args.files, 30), max(args.trials, 1), max(args.walk_files, 0))
    doc = {"files": args.files, "trials": args.trials, "file_bytes": SMALL, "fs": results, "walks": checks}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1) if args.json else table(results) + "\n" + walks_table(checks))


if __name__ == "__main__":
    main()
