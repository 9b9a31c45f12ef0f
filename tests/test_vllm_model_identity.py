"""The model part of a vLLM namespace, from real vLLM engine configs of a real (tiny) model
directory: a copy elsewhere names the same namespace; new weights at the same path, online
quantization, config overrides, another KV dtype or random weights name another; HPKV_MODEL_ID
replaces the content; the path never enters the namespace. And a LoRA request is never looked
up nor saved."""

from __future__ import annotations

import logging
import pickle
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.scheduler import BS, blocks, prompt, scheduler_half
from helpers.vllm import reseed

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from hpkv.demo.model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "model-a")


def engine_config(model: Path, **args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=4096, **args).create_engine_config()


def stage():
    from hpkv.integrations.vllm.layout import BlockLayout

    return BlockLayout(
        ("model.layers.0.attn", "model.layers.1.attn"),
        (8192, 8192),
        32,
        1,
        "FullAttentionSpec:kv_heads=2,head=32,dtype=torch.bfloat16",
    )


def desc(config, override: str | None = None):
    from hpkv import identity
    from hpkv.integrations.vllm import layout, modelid

    identity.forget()  # as a fresh engine process: the files are read again
    return layout.namespace(config, stage(), 0, modelid.model_identity(config, override))


def test_a_copy_shares_and_new_weights_at_the_same_path_do_not(model, tmp_path):
    copy = tmp_path / "node-b" / "models" / "qwen"
    shutil.copytree(model, copy)
    original = desc(engine_config(model))

    assert desc(engine_config(copy)).ns == original.ns
    assert str(model) not in original.to_json() and str(copy) not in original.to_json()
    assert original.model.startswith("content:")
    assert "1 weight file" in dict(original.extra)["model_source"]

    reseed(copy, seed=2)
    assert desc(engine_config(copy)).ns != original.ns


def test_what_changes_the_numerics_on_load_names_another_namespace(model):
    base = desc(engine_config(model)).ns
    others = {
        "online quantization": dict(quantization="fp8"),
        "a config override": dict(hf_overrides={"rope_theta": 5000.0}),
        "another KV dtype": dict(kv_cache_dtype="fp8"),
    }
    names = {what: desc(engine_config(model, **args)).ns for what, args in others.items()}
    assert base not in names.values() and len(set(names.values())) == len(names)


def test_random_weights_are_never_shared_not_even_with_an_override(model):
    one, two = engine_config(model, load_format="dummy"), engine_config(model, load_format="dummy")

    assert desc(one).ns != desc(two).ns  # two engine instances
    assert desc(pickle.loads(pickle.dumps(one))).ns == desc(one).ns  # its workers get it pickled: they agree
    assert desc(one, override="team/qwen@1").ns != desc(two, override="team/qwen@1").ns
    assert desc(one).model.startswith("private:")


def test_hpkv_model_id_replaces_the_content(model, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(model, other)
    reseed(other, seed=3)

    assert desc(engine_config(model), "team/qwen@1").ns == desc(engine_config(other), "team/qwen@1").ns
    assert desc(engine_config(model), "team/qwen@1").ns != desc(engine_config(model), "team/qwen@2").ns
    with_quantization = desc(engine_config(model, quantization="fp8"), "team/qwen@1")
    assert with_quantization.ns != desc(engine_config(model), "team/qwen@1").ns
    assert dict(with_quantization.extra)["model_source"] == "HPKV_MODEL_ID"


def test_hpkv_model_id_keeps_the_draft_model(model, tmp_path):
    """Issue 31, row 2: two engines with one HPKV_MODEL_ID and different draft models."""
    drafts = [tmp_path / "draft-1", tmp_path / "draft-2"]
    shutil.copytree(model, drafts[0])
    shutil.copytree(model, drafts[1])
    reseed(drafts[1], seed=4)
    configs = [engine_config(model) for _ in drafts]
    for config, draft in zip(configs, drafts):
        config.speculative_config = SimpleNamespace(draft_model_config=SimpleNamespace(model=str(draft), revision=None))

    one, two = (desc(config, "team/qwen@1") for config in configs)

    assert one.ns != two.ns
    assert one.ns != desc(engine_config(model), "team/qwen@1").ns  # and none is the plain model's


def test_hpkv_model_id_cannot_pass_for_other_parts(model):
    """Issue 31, row 3: the override's text cannot spell what the engine adds (`+quantization=`)."""
    spelled = desc(engine_config(model), "m+quantization=fp8")
    quantized = desc(engine_config(model, quantization="fp8"), "m")

    assert spelled.ns != quantized.ns
    assert quantized.model == "HPKV_MODEL_ID:m+quantization=fp8"
    assert spelled.model == "HPKV_MODEL_ID:m%2Bquantization%3Dfp8"


def test_a_loader_hpkv_cannot_read_gives_a_private_namespace_and_says_why(model, caplog):
    config = engine_config(model)
    config.load_config.load_format = "tensorizer"
    with caplog.at_level(logging.WARNING, logger="hpkv.identity"):
        got = desc(config)
    assert got.model.startswith("private:")
    assert "HPKV_MODEL_ID" in caplog.text and "tensorizer" in caplog.text


# -- LoRA -----------------------------------------------------------------------------------


@pytest.fixture
def node(node):
    node.start_server()
    return node


def test_a_lora_request_is_neither_looked_up_nor_saved(node, caplog):
    """vLLM's block hashes name an adapter by name and path: another adapter at that path would
    be served this one's KV. The base model's request with the very same blocks hits."""
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata

    scheduler = scheduler_half(node, 1)
    scheduler._lora_logged = False
    adapter = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    request = prompt(node, scheduler, 4, lora_request=adapter)

    with caplog.at_level(logging.INFO, logger="hpkv.vllm.scheduler"):
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.client.stats().leases == 0
    assert "LoRA" in caplog.text
    state = scheduler.table.reqs["r"]
    state.block_ids = [1, 2, 3, 4, 5]
    meta = HpkvConnectorMetadata(loads=[], allocated=[], seq=1, identity=scheduler.identity.get())
    scheduler._add_saves(meta, "r", state, 5 * BS)
    assert meta.saves == []

    base = prompt(node, scheduler, 4)
    base.request_id = "base"
    assert scheduler.get_num_new_matched_tokens(base, 0) == (4 * BS, False)
    scheduler.update_state_after_alloc(base, blocks(1, 2, 3, 4, 5), 4 * BS)


def test_a_lora_request_that_skips_the_prefix_cache_is_not_saved_either(node):
    """Prompt logprobs make vLLM skip reading the prefix cache; the request's blocks must still
    not be saved under the adapter's name."""
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata

    scheduler = scheduler_half(node, 1)
    scheduler._lora_logged = False
    adapter = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    request = prompt(node, scheduler, 4, lora_request=adapter)
    request.skip_reading_prefix_cache = True
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    state = scheduler.table.reqs["r"]
    state.block_ids = [1, 2, 3, 4, 5]
    meta = HpkvConnectorMetadata(loads=[], allocated=[], seq=1, identity=scheduler.identity.get())
    scheduler._add_saves(meta, "r", state, 5 * BS)
    assert meta.saves == []


def test_until_the_identity_is_known_nothing_is_loaded_or_saved(node):
    """The scheduler reads the model's files on a thread of its own: meanwhile every lookup is a
    miss and no step saves, so no KV enters or leaves a namespace another engine could share."""
    from hpkv.identity import IdentityTask, override_identity
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata

    scheduler = scheduler_half(node, 1)
    release = threading.Event()
    scheduler.identity = IdentityTask(lambda: override_identity("test") if release.wait(10) else None, "scope")
    request = prompt(node, scheduler, 4)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    state = scheduler.table.reqs["r"]
    state.block_ids = [1, 2, 3, 4, 5]
    meta = HpkvConnectorMetadata(loads=[], allocated=[], seq=1, identity=scheduler.identity.get())
    scheduler._add_saves(meta, "r", state, 5 * BS)
    assert meta.saves == [] and meta.identity is None

    release.set()
    assert scheduler.identity.wait(10) is not None
    assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * BS, False)
    meta = HpkvConnectorMetadata(loads=[], allocated=[], seq=2, identity=scheduler.identity.get())
    scheduler._add_saves(meta, "r", state, 5 * BS)
    assert len(meta.saves) == 1 and meta.identity == override_identity("test")
