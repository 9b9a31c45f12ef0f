"""Model identity: what a namespace says about the model that computed its KV.

The identity is a digest of the model's CONTENT, so that it changes whenever the weights that
compute the KV could have changed, and only then: a copy at another path or on another node
shares (sharing over a shared storage tier is the point); weights replaced in place, or a
`current -> v1` link switched to v2, do not. Never in it: paths, mtimes, owners, the Hugging Face
revision (reported, not hashed, so a copied snapshot still shares).

Read from the model directory's top level only: config files (every `*.json` but the tokenizer's
and the generation config's, which cannot change the KV of given token ids; `*.py`;
`*.yaml`/`*.yml`) and weight files (`WEIGHT_SUFFIXES`), each by name, size and the sha256 of every
byte (`filedigest`: hashed once per file version on threads, remembered in this user's cache,
Hugging Face blobs taken by name), so that a change of any byte gives another identity. Computed
once per process (cached). A hub id is read from its local snapshot, found as the engines find
it; a model that cannot be found or read has no content identity, and the caller uses a private
one (never shared).

A namespace's model text joins the identity with what else changes the KV (`model_text`):
`id+name=value+...`, every name and value escaped (`escape`: `%`, `+` and `=` percent-encoded),
so no HPKV_MODEL_ID value or override text can pass for another combination of parts.

Primitives: `content_identity(model, revision, download_dir)` (cached; `forget()`), `fingerprint(path)`,
`override_identity(value)`, `private_identity(reason, scope)`, `unreadable_identity(reason, scope, why)`,
`loader_identity(load_format, local_formats, override, scope)`, `ModelIdentity`, `IdentityTask`, `escape(text)`,
`model_text(identity_id, parts)`.
Must not know: engines (no torch, vLLM or SGLang here), namespaces, the pool.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import filedigest
from .units import human_bytes

log = logging.getLogger("hpkv.identity")

FORMAT = b"hpkv-model-fingerprint-2"  # 2: every byte (1 sampled large files)
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
            model_text(self.id, [(what, other.id)]),
            f"{self.source}; {what}: {other.source}",
            self.shared and other.shared,
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
        cost = f" ({self.num_bytes_read / 1024**2:.1f} MiB hashed in {self.seconds:.1f} s)" if self.seconds else ""
        return f"{self.id} from {self.source}{where}{revision}{cost}"


class IdentityTask:
    """An identity computed on a thread of its own, so that the engine starts and serves
    meanwhile: `get()` is None until it is known, and a caller that gets None must neither load
    from nor save into any namespace (every lookup a miss: the engine computes alone). Logged
    when it starts and when it is known."""

    def __init__(self, compute: Callable[[], ModelIdentity] | None, scope: str, known: ModelIdentity | None = None):
        self._identity = known
        self._done = threading.Event()
        self._started = time.monotonic()
        if known is not None:
            self._done.set()
            return
        assert compute is not None
        log.info(
            "HPKV is reading the model's identity (the sha256 of every byte of its weight and config files, "
            "remembered per file version); until it is known, this engine loads no KV from HPKV and saves none"
        )
        threading.Thread(target=self._run, args=(compute, scope), name="hpkv-identity", daemon=True).start()

    @classmethod
    def of(cls, identity: ModelIdentity) -> IdentityTask:
        """One already known."""
        return cls(None, "", identity)

    def _run(self, compute: Callable[[], ModelIdentity], scope: str) -> None:
        try:
            identity = compute()
        except Exception:  # a bug: this engine's KV stays its own
            log.exception("HPKV could not compute the model's identity; this engine's KV stays private to it")
            identity = private_identity("the identity could not be computed", scope)
        self._identity = identity
        self._done.set()
        log.info(
            "HPKV model identity known after %.1f s: %s; HPKV loads and saves from now on",
            time.monotonic() - self._started,
            identity.describe(),
        )

    def get(self) -> ModelIdentity | None:
        return self._identity if self._done.is_set() else None

    def wait(self, timeout_s: float | None = None) -> ModelIdentity | None:
        self._done.wait(timeout_s)
        return self.get()


class NoContentIdentity(Exception):
    """The model's content cannot be read here (the message says why)."""


def override_identity(value: str) -> ModelIdentity:
    """The operator's HPKV_MODEL_ID: the content is not read."""
    return ModelIdentity(f"HPKV_MODEL_ID:{escape(value)}", "HPKV_MODEL_ID")


def escape(text: str) -> str:
    """`text` with `%`, `+` and `=` percent-encoded: one part of a model text."""
    return text.replace("%", "%25").replace("+", "%2B").replace("=", "%3D")


def model_text(identity_id: str, parts: list[tuple[str, str]]) -> str:
    """`identity_id+name=value+...`, names and values escaped: one text for one sequence of parts."""
    return "+".join([identity_id, *(f"{escape(name)}={escape(value)}" for name, value in parts)])


def private_identity(reason: str, scope: str) -> ModelIdentity:
    """An identity no other engine instance has (`scope` names this instance): its KV is
    never shared, and never served to a later engine."""
    return ModelIdentity(f"private:{scope}", f"nothing shareable: {reason}", shared=False)


def loader_identity(
    load_format: str, local_formats: frozenset[str], override: str | None, scope: str
) -> ModelIdentity | None:
    """The identity of the model's own weights where the engine's weight loader alone decides it:
    private for random weights (even with an override), the override, private for a loader that
    does not read local files; None where the content is to be fingerprinted. The caller still
    adds the other models the engine runs (a draft model, a config from elsewhere)."""
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
    num_bytes_read: int  # hashed now; the rest was remembered or named by the Hub
    num_remembered: int = 0
    num_named: int = 0

    @property
    def source(self) -> str:
        """What the digest covers, the same for every copy of the model."""
        num_config, num_weights = self.num_config_files, self.num_weight_files
        return (
            f"content of {num_config} config file{'s' * (num_config != 1)} and {num_weights} weight "
            f"file{'s' * (num_weights != 1)} ({human_bytes(self.weight_bytes)}; every byte)"
        )


def fingerprint(path: Path, num_threads: int | None = None) -> Fingerprint:
    """The content fingerprint of a model directory or single weight file: the sha256 of every
    byte of each file that can change the KV (`filedigest`), with its name and kind. Raises
    NoContentIdentity where there is nothing to read or a file cannot be read."""
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
    kinds = {name: kind for name, _ in files if (kind := _kind(name))}
    chosen = [(name, file) for name, file in files if name in kinds]
    try:
        found = filedigest.digests([file for _, file in chosen], num_threads)
        sizes = {name: os.stat(file).st_size for name, file in chosen}
    except OSError as exc:
        raise NoContentIdentity(f"cannot read {path}: {exc.strerror or exc}") from None
    h = hashlib.blake2b(FORMAT, digest_size=DIGEST_BYTES)
    for name, file in chosen:
        h.update(_frame(kinds[name].encode(), name.encode(), str(sizes[name]).encode(), found.sha256[file].encode()))
    num_weights = sum(kind == "weights" for kind in kinds.values())
    if not chosen:
        raise NoContentIdentity(f"{path} holds no config or weight file")
    return Fingerprint(
        h.hexdigest(),
        len(chosen) - num_weights,
        num_weights,
        sum(size for name, size in sizes.items() if kinds[name] == "weights"),
        found.num_bytes_read,
        found.num_remembered,
        found.num_named,
    )


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
