"""KV files on a storage directory, as the tests see them: which there are, when the server's
write-throughs have settled, and one corrupted in place."""

from __future__ import annotations

from pathlib import Path

from helpers.waiting import wait_for


def kv_files(storage_dir: Path) -> set[Path]:
    return set(Path(storage_dir).rglob("*.kv"))


def settled_files(storage_dir: Path, at_least: int = 0, timeout_s: float = 60.0) -> set[Path]:
    """The KV files once the server's write-throughs have landed: at least `at_least` of them,
    no temporary in flight, and the same set on three polls in a row."""
    seen: list[set[Path]] = []

    def settled() -> tuple[set[Path]] | None:
        files = kv_files(storage_dir)
        in_flight = any(Path(storage_dir).rglob("*.tmp"))
        seen.append(files)
        if len(files) >= at_least and not in_flight and len(seen) >= 3 and seen[-3] == seen[-2] == files:
            return (files,)  # a tuple: an empty set is an answer too
        return None

    return wait_for(settled, timeout_s, interval_s=0.2, what=f"{at_least} KV files under {storage_dir}")[0]


def flip_middle_bytes(path: Path, num_bytes: int = 16) -> bytes:
    """Corrupt a file in place (same inode, same size); returns the corrupted content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + num_bytes, len(data))):
        data[i] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
    return bytes(data)
