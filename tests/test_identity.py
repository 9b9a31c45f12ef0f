"""A model's identity is its content: a copy anywhere shares it; new weights at the same path, a
new config, or a `current` link switched to another version do not. Real files, real copies."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpkv import filedigest
from hpkv import identity as ident
from hpkv.identity import NoContentIdentity, content_identity, fingerprint

TENSOR_BYTES = 3 << 20  # four of them: a 12 MiB file, sampled rather than read whole


def write_safetensors(
    path: Path, seed: int, num_tensors: int = 4, tensor_bytes: int = TENSOR_BYTES, changed: int | None = None
) -> None:
    """A safetensors file of `num_tensors` byte tensors; `changed`: only that tensor takes
    `seed`'s bytes, the others seed 0's (a fine-tune of one layer)."""
    header, offset = {}, 0
    for i in range(num_tensors):
        header[f"model.layers.{i}.weight"] = {
            "dtype": "U8",
            "shape": [tensor_bytes],
            "data_offsets": [offset, offset + tensor_bytes],
        }
        offset += tensor_bytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for i in range(num_tensors):
            tensor_seed = seed if changed is None or changed == i else 0
            f.write(_bytes(tensor_seed * 1000 + i, tensor_bytes))


def _bytes(seed: int, num: int) -> bytes:
    import random

    return random.Random(seed).randbytes(num)


def make_model(directory: Path, seed: int = 1, config: dict | None = None, **weights) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps(config or {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4})
    )
    (directory / "tokenizer.json").write_text(json.dumps({"vocab": ["a", "b"]}))
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    write_safetensors(directory / "model.safetensors", seed, **weights)
    return directory


def digest(path: Path) -> str:
    return fingerprint(path).digest


def test_a_copy_at_another_path_with_other_mtimes_has_the_same_identity(tmp_path):
    model = make_model(tmp_path / "node-a" / "model")
    copy = tmp_path / "node-b" / "elsewhere"
    copy.mkdir(parents=True)
    for file in model.iterdir():
        shutil.copyfile(file, copy / file.name)  # new inodes, new mtimes
        os.utime(copy / file.name, (1, 1))

    assert digest(copy) == digest(model)
    assert content_identity(str(copy)).id == content_identity(str(model)).id


def test_weights_replaced_in_place_change_the_identity(tmp_path):
    model = make_model(tmp_path / "model", seed=1)
    before = digest(model)

    write_safetensors(model / "model.safetensors", seed=2)  # same names, shapes, header, size

    assert digest(model) != before


def test_a_fine_tune_of_one_tensor_changes_the_identity(tmp_path):
    """Every tensor is sampled: the one tensor a partial fine-tune changed is seen."""
    base = make_model(tmp_path / "base", seed=1, num_tensors=64, tensor_bytes=256 << 10, changed=63)
    tuned = make_model(tmp_path / "tuned", seed=2, num_tensors=64, tensor_bytes=256 << 10, changed=63)

    assert digest(base) != digest(tuned)


# -- partial fine-tunes (issue 31, row 1): a changed byte anywhere is another identity -------------


def write_tensors(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    """`directory`/model.safetensors, of these float16 tensors in this order."""
    tensors = {name: np.ascontiguousarray(array, dtype=np.float16) for name, array in tensors.items()}
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F16", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header).encode()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for array in tensors.values():
            f.write(array.tobytes())


def decoder(num_layers: int, hidden: int = 32, vocab: int = 0) -> dict[str, np.ndarray]:
    """The tensors of a decoder with random weights (seed 0), as a checkpoint lists them."""
    rng = np.random.default_rng(0)
    tensors = {}
    if vocab:
        tensors["model.embed_tokens.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32)
    for i in range(num_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"model.layers.{i}.self_attn.{proj}.weight"] = rng.standard_normal(
                (hidden, hidden), dtype=np.float32
            )
    return tensors


def test_two_hundred_retuned_embedding_rows_change_the_identity(tmp_path):
    """Tokens added or retuned: 200 rows of a 16 MiB embedding, the rest of the checkpoint as it was."""
    base = decoder(4, hidden=512, vocab=16384)
    write_tensors(tmp_path / "base", base)
    tuned = dict(base)
    tuned["model.embed_tokens.weight"] = embed = base["model.embed_tokens.weight"].copy()
    embed[3000:3200] += np.random.default_rng(1).standard_normal((200, 512), dtype=np.float32)
    write_tensors(tmp_path / "tuned", tuned)

    assert digest(tmp_path / "tuned") != digest(tmp_path / "base")


def test_one_fine_tuned_k_proj_in_a_checkpoint_of_1200_tensors_changes_the_identity(tmp_path):
    base = decoder(300, hidden=64)
    write_tensors(tmp_path / "base", base)
    tuned = dict(base)
    name = "model.layers.137.self_attn.k_proj.weight"
    tuned[name] = base[name] + np.random.default_rng(2).standard_normal((64, 64), dtype=np.float32)
    write_tensors(tmp_path / "tuned", tuned)

    assert digest(tmp_path / "tuned") != digest(tmp_path / "base")


def test_a_merged_rank_4_lora_changes_the_identity(tmp_path):
    """W + (alpha / r) B A on the k and o projections of ten layers (PEFT's target_modules and
    layers_to_transform), B and A as a short training leaves them: most weights keep their bytes."""
    base = decoder(300, hidden=64)
    write_tensors(tmp_path / "base", base)
    rng = np.random.default_rng(3)
    merged = dict(base)
    for name, weight in base.items():
        if name.endswith(("k_proj.weight", "o_proj.weight")) and 140 <= int(name.split(".")[2]) < 150:
            b, a = rng.standard_normal((64, 4)) * 1e-3, rng.standard_normal((4, 64)) * 1e-3
            merged[name] = weight + 2.0 * b @ a
    write_tensors(tmp_path / "merged", merged)
    kept = np.fromfile(tmp_path / "merged" / "model.safetensors", np.uint8)
    assert 0.99 < (kept == np.fromfile(tmp_path / "base" / "model.safetensors", np.uint8)).mean() < 1

    assert digest(tmp_path / "merged") != digest(tmp_path / "base")


def test_a_config_change_changes_the_identity_and_the_tokenizer_does_not(tmp_path):
    model = make_model(tmp_path / "model")
    before = digest(model)

    (model / "tokenizer.json").write_text(json.dumps({"vocab": ["a", "b", "c"]}))
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.1}))
    (model / "README.md").write_text("notes")
    assert digest(model) == before

    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "num_hidden_layers": 4,
                "rope_scaling": {"type": "linear", "factor": 2.0},
            }
        )
    )
    assert digest(model) != before


def test_switching_a_current_link_to_another_version_changes_the_identity(tmp_path):
    v1, v2 = make_model(tmp_path / "v1", seed=1), make_model(tmp_path / "v2", seed=2)
    current = tmp_path / "current"
    current.symlink_to(v1)
    assert digest(current) == digest(v1)

    current.unlink()
    current.symlink_to(v2)

    assert digest(current) == digest(v2) != digest(v1)


def test_hugging_face_cache_links_are_read_through(tmp_path):
    """A hub snapshot's files are links to blobs: the identity is the blobs' content."""
    model = make_model(tmp_path / "model")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for file in model.iterdir():
        (snapshot / file.name).symlink_to(file)
    assert digest(snapshot) == digest(model)


def test_a_single_weight_file_of_another_format_is_read_whole(tmp_path):
    gguf = tmp_path / "model.gguf"
    data = bytearray(_bytes(5, 20 << 20))
    gguf.write_bytes(data)
    before = digest(gguf)
    data[7 << 20] ^= 1  # one bit, anywhere
    gguf.write_bytes(data)
    assert digest(gguf) != before
    assert fingerprint(gguf).num_weight_files == 1


def test_a_hub_id_is_read_from_its_local_snapshot_and_shares_with_a_copy(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = make_model(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    copy = tmp_path / "copy"
    shutil.copytree(snapshot, copy)

    found = content_identity("acme/tiny", None, str(tmp_path / "hub"))

    assert found.revision == commit  # reported...
    assert found.id == content_identity(str(copy)).id  # ...not hashed: the copy still shares
    assert str(snapshot) in found.describe() and commit in found.describe()


def test_a_hub_id_without_a_local_snapshot_has_no_content_identity(tmp_path):
    with pytest.raises(NoContentIdentity, match="no local Hugging Face snapshot"):
        content_identity("acme/not-downloaded", None, str(tmp_path / "empty-hub"))
    with pytest.raises(NoContentIdentity):
        content_identity(str(tmp_path / "missing" / "dir"))


def test_the_override_and_private_identities():
    assert ident.override_identity("team/model@v7").id == "HPKV_MODEL_ID:team/model@v7"
    one, other = ident.private_identity("random weights", "a"), ident.private_identity("random weights", "b")
    assert not one.shared and one.id != other.id


def test_hpkv_status_shows_each_namespace_identity_and_where_it_came_from():
    from rich.console import Console

    from helpers.stats import stats_from
    from hpkv.keys import NamespaceDesc
    from hpkv.status import _namespaces_table

    source = "content of 2 config files and 4 weight files (16.0 GiB; headers and sampled chunks)"
    described = NamespaceDesc(
        engine="vllm",
        model="content:0123abcd+quantization=fp8",
        dtype="bfloat16",
        layout="LBHNC",
        block_size=32,
        num_layers=2,
        entry_bytes=8192,
        extra=(("model_source", source),),
    )
    older = NamespaceDesc(
        engine="vllm",
        model="/models/m@main",
        dtype="bfloat16",
        layout="LBHNC",
        block_size=32,
        num_layers=2,
        entry_bytes=8192,
    )
    counts = {"lookups": 1, "lookup_keys": 4, "hit_keys_dram": 2, "hit_keys_storage": 1}
    stats = stats_from(
        {"store": dict(counts), "namespaces": {d.ns: {"desc": d.to_json(), **counts} for d in (described, older)}}
    )
    console = Console(record=True, width=400)

    console.print(_namespaces_table(stats))

    text = console.export_text()
    assert "content:0123abcd+quantization=fp8" in text and source in text
    assert "model from" in text


# -- the cost: each file read once per version, Hugging Face blobs not at all ------------------------


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """This test's digest cache, with files written a moment ago remembered too."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(filedigest, "RACY_S", 0.0)


def test_a_later_start_reads_nothing_and_a_file_rewritten_in_place_is_read_again(tmp_path):
    model = make_model(tmp_path / "model")
    first = fingerprint(model)
    assert first.num_bytes_read > 12 << 20

    again = fingerprint(model)
    assert again.num_bytes_read == 0 and again.num_remembered == 2 and again.digest == first.digest

    weights = model / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:  # one byte, same size, and the mtime put back: the ctime moves
        f.seek(st.st_size // 3)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))

    changed = fingerprint(model)
    assert changed.num_bytes_read == st.st_size and changed.digest != first.digest


def test_a_cache_directory_others_can_write_or_a_link_is_not_used(tmp_path, caplog):
    model = make_model(tmp_path / "model")
    cache = filedigest.cache_dir()
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="hpkv.identity"):
        assert fingerprint(model).digest == fingerprint(model).digest
    assert fingerprint(model).num_remembered == 0 and list(cache.iterdir()) == []
    assert "others can write it" in caplog.text

    cache.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    cache.symlink_to(tmp_path / "elsewhere")
    fingerprint(model)
    assert fingerprint(model).num_remembered == 0 and list((tmp_path / "elsewhere").iterdir()) == []


def hub_snapshot(root: Path, model: Path) -> Path:
    """`model` as huggingface_hub caches it: weights in blobs named by their sha256, linked from
    the snapshot after they are written; small files kept in git under their git sha1."""
    import hashlib

    repo = root / "models--acme--tiny"
    snapshot = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(model.iterdir()):
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            name = hashlib.sha256(data).hexdigest()
        else:
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / name).write_bytes(data)
        (snapshot / file.name).symlink_to(f"../../blobs/{name}")
    return snapshot


def test_hugging_face_blobs_are_taken_by_name_and_share_with_a_plain_copy(tmp_path):
    model = make_model(tmp_path / "model")
    snapshot = hub_snapshot(tmp_path / "hub", model)

    got = fingerprint(snapshot)

    assert got.digest == fingerprint(model).digest
    assert got.num_named == 1 and got.num_bytes_read < 1 << 20  # the config files only (git sha1: read)


def test_a_blob_written_through_its_link_is_read_not_trusted_by_name(tmp_path):
    """save_pretrained over a snapshot writes through the links, into the blobs."""
    model = make_model(tmp_path / "model")
    snapshot = hub_snapshot(tmp_path / "hub", model)
    before = fingerprint(snapshot).digest
    time.sleep(0.05)  # past the link's timestamp tick

    write_safetensors(snapshot / "model.safetensors", seed=2)

    got = fingerprint(snapshot)
    assert got.num_named == 0 and got.digest != before


def test_a_blob_others_can_write_is_read_not_trusted_by_name(tmp_path):
    snapshot = hub_snapshot(tmp_path / "hub", make_model(tmp_path / "model"))
    (snapshot.parents[1] / "blobs").chmod(0o777)

    assert fingerprint(snapshot).num_named == 0


def test_an_identity_being_computed_is_none_until_known():
    started, release = threading.Event(), threading.Event()

    def compute():
        started.set()
        release.wait(10)
        return ident.override_identity("m")

    task = ident.IdentityTask(compute, "scope")
    started.wait(10)
    assert task.get() is None

    release.set()
    assert task.wait(10) == ident.override_identity("m") == task.get()
