"""`hpkv clear --model NAME`: every namespace of a served model (every rank, every load-time
variant), in the DRAM pool and in storage, named as people name the model; other models' KV
stays. Against a real `hpkv server` process (conftest's `server` and `env`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from helpers.cli import DESC, hpkv, wait_for_storage, write_entries
from hpkv.identity import content_identity
from hpkv.tiers import Tier


def _model_dir(path: Path, seed: int) -> Path:
    """A model directory as the engines fingerprint it: a config and a weight file."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "seed": seed}))
    (path / "model.safetensors").write_bytes(bytes([seed]) * 70_000)
    return path


def kv_files(storage: Path, ns: str) -> list[Path]:
    return sorted((storage / ns).rglob("*.kv"))


def test_clear_model_removes_every_namespace_of_that_model_and_nothing_else(server, env, tmp_path):
    served = _model_dir(tmp_path / "served", 1)
    other = _model_dir(tmp_path / "other", 2)
    ident = content_identity(str(served)).id
    descs = {
        "rank0": dataclasses.replace(DESC, model=ident),
        "rank1": dataclasses.replace(DESC, model=ident, rank=1),
        "quantized": dataclasses.replace(DESC, model=ident + "+quantization=fp8"),
        "other": dataclasses.replace(DESC, model=content_identity(str(other)).id),
        "override": dataclasses.replace(DESC, model="HPKV_MODEL_ID:team-a/llm-v3"),
    }
    storage = tmp_path / "storage"
    with server.client() as client:
        written = {name: write_entries(client, 2, desc) for name, desc in descs.items()}
        wait_for_storage(client, 10)
        result = hpkv(env, "clear", "--model", str(served))
        assert result.returncode == 0, result.stderr
        for name in ("rank0", "rank1", "quantized"):
            ns, keys = written[name]
            assert f"memory: dropped 2 entries of namespace {ns}" in result.stdout
            assert f"storage: removed 2 entry files of namespace {ns}" in result.stdout
            assert client.lookup(ns, keys).num_hit == 0
            assert kv_files(storage, ns) == []
        for name in ("other", "override"):
            ns, keys = written[name]
            assert client.lookup(ns, keys).tiers == (Tier.DRAM,) * 2
            assert len(kv_files(storage, ns)) == 2

        result = hpkv(env, "clear", "--model", "team-a/llm-v3")  # the HPKV_MODEL_ID it was served under
        assert result.returncode == 0, result.stderr
        assert client.lookup(*written["override"]).num_hit == 0
        assert client.lookup(*written["other"]).num_hit == 2


def test_clear_model_without_a_server_reads_the_namespaces_in_storage(server, env, tmp_path):
    served = _model_dir(tmp_path / "served", 3)
    storage = tmp_path / "storage"
    with server.client() as client:
        ns, _ = write_entries(client, 3, dataclasses.replace(DESC, model=content_identity(str(served)).id))
        other_ns, _ = write_entries(client, 2)
        wait_for_storage(client, 5)
    assert server.stop() == 0
    result = hpkv(env, "clear", "--model", str(served))
    assert result.returncode == 0, result.stderr
    assert f"storage: removed 3 entry files of namespace {ns}" in result.stdout
    assert kv_files(storage, ns) == [] and len(kv_files(storage, other_ns)) == 2
    assert not server.socket.exists()  # clearing never starts a server


def test_clear_model_of_an_unknown_model_says_nothing_matched(server, env, tmp_path):
    with server.client() as client:
        write_entries(client, 2)
        result = hpkv(env, "clear", "--model", str(_model_dir(tmp_path / "never-served", 4)))
        assert result.returncode == 0, result.stderr
        assert "no namespace of model" in result.stdout and "nothing to remove" in result.stdout
        assert client.stats().dram.num_entries == 2


def test_clear_model_and_namespace_together_is_a_usage_error(env):
    result = hpkv(env, "clear", "--model", "x", "--namespace", "ab")
    assert result.returncode == 2 and "not both" in result.stderr


def test_clear_model_matches_the_identity_exactly_and_only_descriptions_that_hash_to_their_directory(
    server, env, tmp_path
):
    """`--model llama` is `HPKV_MODEL_ID=llama` and its load-time variants, not the model served
    as `llama+v2-finetune`; and a `namespace.json` another model's directory holds, relabelled
    to say `llama`, names nothing (it does not hash to its directory's name)."""
    storage = tmp_path / "storage"
    descs = {
        "llama": dataclasses.replace(DESC, model="HPKV_MODEL_ID:llama"),
        "llama-fp8": dataclasses.replace(DESC, model="HPKV_MODEL_ID:llama+quantization=fp8"),
        "finetune": dataclasses.replace(DESC, model="HPKV_MODEL_ID:llama+v2-finetune"),
        "relabelled": dataclasses.replace(DESC, model="HPKV_MODEL_ID:mistral"),
    }
    with server.client() as client:
        written = {name: write_entries(client, 2, desc) for name, desc in descs.items()}
        wait_for_storage(client, 8)
        result = hpkv(env, "clear", "--model", "llama")
        assert result.returncode == 0, result.stderr
        for name in ("llama", "llama-fp8"):
            assert client.lookup(*written[name]).num_hit == 0
        for name in ("finetune", "relabelled"):
            assert client.lookup(*written[name]).num_hit == 2, name
    assert server.stop() == 0
    relabelled_ns = written["relabelled"][0]
    label = storage / relabelled_ns / "namespace.json"
    label.write_text(dataclasses.replace(DESC, model="HPKV_MODEL_ID:llama").to_json() + "\n")

    result = hpkv(env, "clear", "--model", "llama")  # no server: the descriptions in storage

    assert result.returncode == 0, result.stderr
    for name in ("finetune", "relabelled"):
        assert written[name][0] not in result.stdout
        assert len(kv_files(storage, written[name][0])) == 2, name
