"""Asynchronous saves on a real vLLM (forced on for the CPU, where they are off by default): with
a KV cache of a few prompts' blocks, every prompt's blocks are recycled for the next ones while
their saves may still be in flight, and each prompt later served from HPKV's DRAM tier gives
exactly what vLLM's own prefix-cache hit gave."""

from __future__ import annotations

import pytest

from helpers.vllm import Engine, same_output, serving
from helpers.vllm_node import engine_node
from hpkv.demo.model import prompt_text

pytestmark = [
    pytest.mark.engine,
    pytest.mark.vllm,
    pytest.mark.timeout(900),
]

ASYNC = '{"kv_connector":"HpkvConnectorV1", "kv_role":"kv_both", "kv_connector_extra_config":{"hpkv.async_save":true}}'
NUM_BLOCKS = 128  # 4,096 tokens: about two and a half of these prompts
PROMPTS = [prompt_text(1500, seed=300 + i) for i in range(6)]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    extra = {"HPKV_KV_STORAGE_ENABLE": "false"}
    with engine_node(tmp_path_factory.mktemp("vllm-async"), "hpkv-async-", extra) as node:
        yield node


@pytest.fixture(scope="module")
def engine(node, model):
    engine = Engine(
        "async",
        model,
        node.env(),
        node.logs,
        extra_flags=(
            "--kv-transfer-config",
            ASYNC,
            "--num-gpu-blocks-override",
            str(NUM_BLOCKS),
            "--max-model-len",
            "2048",
        ),
    )
    with serving(engine, node.shm):
        yield engine


def test_prompts_whose_blocks_were_recycled_load_from_dram_identical_to_vllms_own_hit(engine):
    assert "asynchronous saves" in engine.log_text()
    references = [engine.reference(prompt) for prompt in PROMPTS]  # computed, saved, then vLLM's own hit

    for prompt, reference in zip(PROMPTS, references):
        engine.reset_prefix_cache()  # vLLM's own cache only: HPKV's DRAM tier keeps every prompt
        before = engine.counters()
        answer = engine.complete(prompt)
        got = engine.counters() - before
        assert got["host"] >= 1400 and got["device"] == 0
        assert same_output(answer, reference)
