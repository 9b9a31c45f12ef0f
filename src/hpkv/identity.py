"""Model identity: what a namespace says about the model that computed its KV.

The identity is a digest of the model's CONTENT, so that it changes whenever the weights that
compute the KV could have changed, and only then: a copy at another path or on another node
shares (sharing over a shared storage tier is the point); weights replaced in place, or a
`current -> v1` link switched to v2, do not. Never in it: paths, mtimes, owners, the Hugging Face
revision (reported, not hashed, so a copied snapshot still shares).

Read once per process (cached), from the model directory's top level only: config files whole
(every `*.json` but the tokenizer's and the generation config's, which cannot change the KV of
given token ids; `*.py`; `*.yaml`/`*.yml`); weight files (`WEIGHT_SUFFIXES`) by name and size,
whole when small, else sampled (the safetensors header, a sample of every tensor, NUM_CHUNKS
chunks): about TENSOR_SAMPLE_BUDGET + CHUNK_BUDGET reads per model, plus a header per file.
A change none of these bytes sees keeps the identity: such deployments set HPKV_MODEL_ID.
A hub id is read from its local snapshot, found as the engines find it; a model that cannot be
found or read has no content identity, and the caller uses a private one (never shared).

Primitives: `content_identity(model, revision, download_dir)` (cached; `forget()`), `fingerprint(path)`,
`override_identity(value)`, `private_identity(reason, scope)`, `unreadable_identity(reason, scope, why)`,
`loader_identity(load_format, local_formats, override, scope)`, `ModelIdentity`.
Must not know: engines (no torch, vLLM or SGLang here), namespaces, the pool.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from .units import human_bytes

log = logging.getLogger("hpkv.identity")

FORMAT = b"hpkv-model-fingerprint-1"
DIGEST_BYTES = 16
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".ckpt",
    ".tensors",
    ".npz",
    ".npy",
    ".h5",
    ".msgpack",
    ".pkl",
    ".nemo",
)
CONFIG_SUFFIXES = (".json", ".py", ".yaml", ".yml")
# Files that cannot change the KV of given token ids: the tokenizer (the ids are the keys),
# sampling defaults, chat templates.
NOT_KV_FILES = frozenset(
    (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "generation_config.json",
        "chat_template.json",
    )
)
FULL_READ_BYTES = 8 << 20  # a file up to this size is hashed whole
CONFIG_MAX_BYTES = 64 << 20  # a config-like file larger than this is sampled like a weight file
NUM_CHUNKS = 16  # per file, at most; fewer when the model has many files
CHUNK_BUDGET = 1024  # chunks for the whole model
CHUNK_BYTES = 4 << 10
TENSOR_SAMPLE_BYTES = 4 << 10
MAX_TENSOR_SAMPLES = 1024  # per file, at most, spread evenly over its tensors
TENSOR_SAMPLE_BUDGET = 4096  # tensor samples for the whole model
HEAD_BYTES = 1 << 20  # non-safetensors weight files: their header region
TAIL_BYTES = 64 << 10  # ... and their end (a zip's central directory)
SAFETENSORS_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class ModelIdentity:
    """`id` goes into the namespace; the rest is for the log and `hpkv status`."""

    id: str  # "content:<hex>", "HPKV_MODEL_ID:<value>" or "private:<scope>"
    source: str  # what the id was derived from, short and the same for every copy of the model
    shared: bool = True  # False: private to this engine instance, never shared
    location: str = ""  # where the model was read (log only: never in the id)
    revision: str = ""  # the Hugging Face snapshot revision, where there is one (log only)
    num_weight_files: int = field(default=0, compare=False)
    num_bytes_read: int = field(default=0, compare=False)
    seconds: float = field(default=0.0, compare=False)

    def with_part(self, what: str, other: ModelIdentity) -> ModelIdentity:
        """This identity combined with another directory's (a config or draft model)."""
        return ModelIdentity(
            f"{self.id}+{what}={other.id}",
            f"{self.source}; {what}: {other.source}",
            self.shared,
            self.location,
            self.revision,
            self.num_weight_files,
            self.num_bytes_read + other.num_bytes_read,
            self.seconds + other.seconds,
        )

    def describe(self) -> str:
        """One line for the log."""
        where = f" at {self.location}" if self.location else ""
        revision = f", snapshot revision {self.revision}" if self.revision else ""
        cost = (
            f" ({self.num_bytes_read / 1024**2:.1f} MiB read in {self.seconds * 1e3:.0f} ms)"
            if self.num_bytes_read
            else ""
        )
        return f"{self.id} from {self.source}{where}{revision}{cost}"


class NoContentIdentity(Exception):
    """The model's content cannot be read here (the message says why)."""


def override_identity(value: str) -> ModelIdentity:
    """The operator's HPKV_MODEL_ID: the content is not read."""
    return ModelIdentity(f"HPKV_MODEL_ID:{value}", "HPKV_MODEL_ID")


def private_identity(reason: str, scope: str) -> ModelIdentity:
    """An identity no other engine instance has (`scope` names this instance): its KV is
    never shared, and never served to a later engine."""
    return ModelIdentity(f"private:{scope}", f"nothing shareable: {reason}", shared=False)


def loader_identity(
    load_format: str, local_formats: frozenset[str], override: str | None, scope: str
) -> ModelIdentity | None:
    """The identity the engine's weight loader alone decides: private for random weights (even
    with an override), the override, private for a loader that does not read local files; None
    where the content is to be fingerprinted."""
    if load_format == "dummy":
        return private_identity("random weights (--load-format dummy)", scope)
    if override:
        return override_identity(override)
    if load_format not in local_formats:
        return unreadable_identity(
            f"--load-format {load_format}", scope, f"the {load_format} loader reads weights HPKV cannot fingerprint"
        )
    return None


def unreadable_identity(reason: str, scope: str, why: str) -> ModelIdentity:
    """`private_identity` for weights this module cannot read, said in the log with the fix."""
    log.warning(
        "HPKV cannot tell the model's identity (%s): this engine's KV stays private to it (no hits from "
        "other engines or after a restart). Fix: give a local model directory, or set HPKV_MODEL_ID to "
        "an identity you manage for these weights",
        why,
    )
    return private_identity(reason, scope)


def content_identity(model: str, revision: str | None = None, download_dir: str | None = None) -> ModelIdentity:
    """The content identity of `model` (a directory, a single weight file, or a hub id with its
    local snapshot). Raises NoContentIdentity. Computed once per process per argument set."""
    return _content_identity(str(model), revision or None, download_dir or None)


def forget() -> None:
    """Drop the identities computed so far: the next call reads the files again."""
    _content_identity.cache_clear()


@functools.cache
def _content_identity(model: str, revision: str | None, download_dir: str | None) -> ModelIdentity:
    path, snapshot_revision = locate(model, revision, download_dir)
    started = time.perf_counter()
    fp = fingerprint(path)
    return ModelIdentity(
        f"content:{fp.digest}",
        fp.source,
        location=str(path),
        revision=snapshot_revision,
        num_weight_files=fp.num_weight_files,
        num_bytes_read=fp.num_bytes_read,
        seconds=time.perf_counter() - started,
    )


def locate(model: str, revision: str | None, download_dir: str | None) -> tuple[Path, str]:
    """(the local directory or file to read, its hub snapshot revision or ""). A local path is
    taken as given; anything else as a hub id in the local Hugging Face cache."""
    path = Path(model).expanduser()
    if path.exists():
        return path, _snapshot_revision(path)
    if model.count("/") > 1 or model.startswith((".", "/", "~")) or "://" in model:
        raise NoContentIdentity(f"{model!r} is not a local path, nor a Hugging Face hub id")
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception as exc:  # not cached here, no huggingface_hub, a bad id
        raise NoContentIdentity(
            f"{model!r} is no local path and has no local Hugging Face snapshot ({type(exc).__name__}: {exc})"
        ) from None
    return snapshot, _snapshot_revision(snapshot)


def _snapshot_revision(path: Path) -> str:
    """The commit of a Hugging Face cache snapshot (`.../snapshots/<commit>`), else ""."""
    resolved = path.resolve() if path.is_dir() else path.resolve().parent
    for part in (resolved, *resolved.parents):
        if part.parent.name == "snapshots" and len(part.name) == 40:
            return part.name
    return ""


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # hex
    num_config_files: int
    num_weight_files: int
    weight_bytes: int
    num_bytes_read: int

    @property
    def source(self) -> str:
        """What the digest covers, the same for every copy of the model."""
        num_config, num_weights = self.num_config_files, self.num_weight_files
        return (
            f"content of {num_config} config file{'s' * (num_config != 1)} and {num_weights} weight "
            f"file{'s' * (num_weights != 1)} ({human_bytes(self.weight_bytes)}; headers and sampled chunks)"
        )


def fingerprint(path: Path) -> Fingerprint:
    """The content fingerprint of a model directory or single weight file. Raises
    NoContentIdentity where there is nothing to read."""
    path = Path(path)
    if path.is_file():
        files = [(path.name, path)]
    elif path.is_dir():
        files = sorted(
            (entry.name, Path(entry.path))
            for entry in os.scandir(path)
            if not entry.name.startswith(".") and entry.is_file()
        )
    else:
        raise NoContentIdentity(f"{path} is neither a file nor a directory")
    h = hashlib.blake2b(FORMAT, digest_size=DIGEST_BYTES)
    num_config = num_weights = weight_bytes = num_read = 0
    num_weight_files = max(1, sum(_kind(name) == "weights" for name, _ in files))
    tensor_samples = max(16, min(MAX_TENSOR_SAMPLES, TENSOR_SAMPLE_BUDGET // num_weight_files))
    num_chunks = max(2, min(NUM_CHUNKS, CHUNK_BUDGET // num_weight_files))
    for name, file in files:
        kind = _kind(name)
        if kind is None:
            continue
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(_frame(kind.encode(), name.encode(), str(size).encode()))
                whole = size <= (CONFIG_MAX_BYTES if kind == "config" else FULL_READ_BYTES)
                num_read += _hash_whole(f, h) if whole else _hash_samples(f, size, name, h, tensor_samples, num_chunks)
        except OSError as exc:
            raise NoContentIdentity(f"cannot read {file}: {exc.strerror or exc}") from None
        if kind == "config":
            num_config += 1
        else:
            num_weights += 1
            weight_bytes += size
    if not num_weights and not num_config:
        raise NoContentIdentity(f"{path} holds no config or weight file")
    return Fingerprint(h.hexdigest(), num_config, num_weights, weight_bytes, num_read)


def _kind(name: str) -> str | None:
    lower = name.lower()
    if lower.endswith(WEIGHT_SUFFIXES):
        return "weights"
    if lower.endswith(CONFIG_SUFFIXES) and lower not in NOT_KV_FILES:
        return "config"
    return None


def _frame(*parts: bytes) -> bytes:
    """Length-prefixed parts: no two different sequences of parts give the same bytes."""
    return b"".join(struct.pack("<Q", len(part)) + part for part in parts)


def _hash_whole(f, h) -> int:
    num = 0
    while chunk := f.read(1 << 20):
        h.update(chunk)
        num += len(chunk)
    return num


def _read_at(f, offset: int, length: int, h) -> int:
    data = os.pread(f.fileno(), length, offset)
    h.update(_frame(str(offset).encode(), data))
    return len(data)


def _hash_samples(f, size: int, name: str, h, tensor_samples: int, num_chunks: int) -> int:
    """A large file: its header, a sample of its tensors (safetensors), and fixed chunks."""
    num = 0
    offsets: list[tuple[int, int]] = []
    header = _safetensors_header(f, size) if name.lower().endswith(".safetensors") else None
    if header is not None:
        raw, tensors = header
        h.update(_frame(b"0", raw))  # the header: every tensor's name, dtype, shape and place
        num += len(raw)
        # In the header's own order (the same in every copy), evenly spread.
        for start, end in _spans(tensors[:: max(1, -(-len(tensors) // tensor_samples))], len(raw), size):
            middle = max(start, (start + end - TENSOR_SAMPLE_BYTES) // 2)
            offsets.append((middle, min(TENSOR_SAMPLE_BYTES, end - middle)))
    else:
        offsets += [(0, HEAD_BYTES), (size - TAIL_BYTES, TAIL_BYTES)]
    last = size - CHUNK_BYTES
    offsets += [(last * i // (num_chunks - 1), CHUNK_BYTES) for i in range(num_chunks)]
    for offset, length in sorted(set(offsets)):
        num += _read_at(f, offset, length, h)
    return num


def _safetensors_header(f, size: int) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
    """(the header's bytes with their length prefix, each tensor's data offsets as written), or
    None for a file that is not a safetensors file (then sampled like any other). The offsets
    are found by a pattern rather than a JSON parse: a 160-file MoE checkpoint has 50,000
    tensors, whose parse would cost more than all the reads; the header is hashed whole anyway."""
    head = os.pread(f.fileno(), 8, 0)
    if len(head) < 8:
        return None
    (header_bytes,) = struct.unpack("<Q", head)
    if header_bytes > min(SAFETENSORS_MAX_HEADER, size - 8):
        return None
    text = os.pread(f.fileno(), header_bytes, 8)
    if not text.startswith(b"{"):
        return None
    return head + text, _DATA_OFFSETS.findall(text)


_DATA_OFFSETS = re.compile(rb'"data_offsets"\s*:\s*\[\s*(\d+)\s*,\s*(\d+)\s*\]')


def _spans(tensors: list[tuple[bytes, bytes]], data_start: int, size: int) -> list[tuple[int, int]]:
    """The absolute (start, end) of these tensors' data, those inside the file."""
    spans = []
    for begin, finish in tensors:
        start, end = data_start + int(begin), data_start + int(finish)
        if data_start <= start < end <= size:
            spans.append((start, end))
    return spans
