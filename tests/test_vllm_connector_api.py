"""HpkvConnectorV1 inside the installed vLLM's own Scheduler, with no engine: vLLM's Scheduler,
Request, SchedulerOutput, KVCacheConfig and KVConnectorOutput, the connector's worker half on
real CPU KV tensors, and a real HPKV server. Only the model's forward pass is played by the
test (it writes each computed block's bytes from its tokens, as a model's KV depends on them).

These are the stories whose vLLM side moved between minors (the connector's version shims,
`hpkv.integrations.vllm.compat`), so `make test-vllm-wheel` runs them on vLLM 0.33/0.34 too."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from helpers.env import use_hpkv_env

pytestmark = pytest.mark.vllm

BS, LAYERS, HEADS, HEAD, NUM_BLOCKS = 32, 2, 2, 16, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture
def vllm_side(node, model, monkeypatch, request):
    """vLLM's Scheduler with HpkvConnectorV1 (its scheduler half) and the connector's worker
    half over one rank's KV tensors, on a running HPKV server. Both layers in one KV cache
    group, or (parametrized with a window) layer 0 full attention and layer 1 a sliding window
    of that many tokens, each in a group of its own (vLLM's hybrid KV cache manager)."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from hpkv.integrations.vllm import connector as conn
    from hpkv.integrations.vllm import plugin

    node.start_server()
    use_hpkv_env(monkeypatch, {**node.env, "VLLM_ENABLE_HPKV": "1", "VLLM_HPKV_TOKEN_THRESHOLD": "0"})
    monkeypatch.setattr(conn, "_this_rank", lambda vllm_config: 0)  # one rank, no process group
    plugin.register()
    config = EngineArgs(
        model=str(model),
        max_model_len=1024,
        block_size=BS,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # a prompt of 4 blocks is computed in 3 steps
        kv_transfer_config=KVTransferConfig(kv_connector="HpkvConnectorV1", kv_role="kv_both"),
    ).create_engine_config()
    config.cache_config.kv_cache_layout = "LBHNC"  # as vLLM's engine core resolves it for HPKV
    config.scheduler_config.max_num_batched_tokens = 64
    config.scheduler_config.enable_chunked_prefill = True
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    geometry = dict(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    window = getattr(request, "param", None)
    if window is None:
        groups = [KVCacheGroupSpec(LAYER_NAMES, FullAttentionSpec(**geometry))]
    else:
        groups = [
            KVCacheGroupSpec(LAYER_NAMES[:1], FullAttentionSpec(**geometry)),
            KVCacheGroupSpec(LAYER_NAMES[1:], SlidingWindowSpec(**geometry, sliding_window=window)),
        ]
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    init_none_hash(sha256)
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
        log_stats=True,
    )
    worker = conn.HpkvConnectorV1(config, KVConnectorRole.WORKER, kv_cache_config)
    # One layer's paged KV as vLLM's CPU backend lays it out for HPKV: (blocks, heads, tokens, K|V).
    caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.float16) for name in LAYER_NAMES}
    worker.register_kv_caches(caches)
    side = VllmSide(scheduler, worker, caches, [group.layer_names for group in groups])
    try:
        yield side
    finally:
        worker.shutdown()
        scheduler.shutdown()


class VllmSide:
    def __init__(self, scheduler, worker, caches, group_layers) -> None:
        self.scheduler, self.worker, self.caches, self.group_layers = scheduler, worker, caches, group_layers
        self.requests: dict[str, object] = {}
        self.steps = 0

    def add(self, req_id: str, tokens: list[int], **sampling):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=1, **sampling)
        request = Request(req_id, list(tokens), params, None, block_hasher=get_request_block_hasher(BS, sha256))
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self):
        """One engine step: vLLM schedules, the worker half runs its hooks around the forward
        pass in the model runner's order, and vLLM reads the step's output."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # vLLM starts asynchronous loads after the forward pass: none is read here
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            request = self.requests[req_id]
            self._forward(request, out.num_scheduled_tokens[req_id])
            sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving or set(),
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_stats=self.worker.get_kv_connector_stats(),
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        # vLLM 0.34 dropped req_id_to_index, which earlier minors require.
        extra = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if "req_id_to_index" in fields else {}
        runner_output = ModelRunnerOutput(ids, sampled_token_ids=sampled, kv_connector_output=kv_output, **extra)
        self.scheduler.update_from_output(out, runner_output)
        self.steps += 1
        return out

    def _forward(self, request, num_scheduled: int) -> None:
        """The model's part: the blocks this step computed get bytes that depend on their tokens
        (vLLM has already counted them as computed)."""
        stop = request.num_computed_tokens
        null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        group_ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        for layers, block_ids in zip(self.group_layers, group_ids):
            for index in range((stop - num_scheduled) // BS, min(-(-stop // BS), len(block_ids))):
                for name in layers if block_ids[index] != null else ():
                    value = kv_value(request.all_token_ids, index, LAYER_NAMES.index(name))
                    self.caches[name][block_ids[index]].fill_(float(value))

    def run(self, req_id: str, max_steps: int = 20) -> None:
        for _ in range(max_steps):
            if req_id not in self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"request {req_id} still running after {max_steps} steps")

    def block_bytes(self, block_ids: list[int], layers=LAYER_NAMES) -> list[bytes]:
        return [b"".join(self.caches[name][b].numpy().tobytes() for name in layers) for b in block_ids]


def kv_value(tokens, index: int, layer: int) -> int:
    """A block's KV as a function of the tokens up to its end (fp16-exact)."""
    return (sum(tokens[: (index + 1) * BS]) * 31 + index * 7 + layer) % 1000 + 1


def expected_bytes(tokens, blocks, layers=range(LAYERS)) -> list[bytes]:
    import torch

    return [
        b"".join(
            torch.full((HEADS, BS, 2 * HEAD), float(kv_value(tokens, index, layer)), dtype=torch.float16)
            .numpy()
            .tobytes()
            for layer in layers
        )
        for index in blocks
    ]


PROMPT = [(i * 37) % 500 + 3 for i in range(4 * BS + 1)]


def test_a_prompt_prefilled_over_several_steps_is_saved_whole_and_loads_byte_for_byte(vllm_side):
    """Request a's 4 blocks are computed over 3 steps (chunked prefill: the later chunks are
    vLLM's cached requests); HPKV saves each block at the step that fills it. Once vLLM's own
    prefix cache is reset and its KV tensors wiped, request b (the same prompt) hits all 4 in
    HPKV's DRAM tier and gets a's bytes in its own blocks."""
    side = vllm_side
    side.add("a", PROMPT)
    side.run("a")
    assert side.steps >= 3  # the later chunks came as cached requests
    assert_a_repeat_hits_every_block_in_dram(side)


def test_a_request_resumed_after_preemption_keeps_saving_its_blocks(vllm_side):
    """vLLM preempts request a after its first chunk (a prefix-cache reset that takes running
    requests too) and resumes it (0.31-0.33: among the cached requests, with a whole new block
    table; 0.34: among the new ones, sent in full): HPKV loads the blocks it saved before, saves
    those computed after the resume from their new blocks, and a repeat hits all 4."""
    side = vllm_side
    side.add("a", PROMPT)
    side.step()  # blocks 0 and 1 computed and saved
    assert side.scheduler.reset_prefix_cache(reset_running_requests=True)
    side.run("a")
    assert_a_repeat_hits_every_block_in_dram(side)


def assert_a_repeat_hits_every_block_in_dram(side) -> None:
    """vLLM's own prefix cache reset and its KV tensors wiped, request b (the same prompt) gets
    all 4 blocks from HPKV's DRAM tier, with a's bytes."""
    assert side.scheduler.reset_prefix_cache()
    for cache in side.caches.values():
        cache.zero_()
    side.add("b", PROMPT)
    (new,) = side.step().scheduled_new_reqs
    assert new.num_computed_tokens == 4 * BS
    assert side.block_bytes(new.block_ids[0][:4]) == expected_bytes(PROMPT, range(4))


def test_a_request_with_prompt_logprobs_leases_nothing(vllm_side, node):
    """vLLM drops any connector hit for a request that wants prompt logprobs (it must compute
    every prompt token): HPKV answers no hit and pins nothing, though all of its blocks are in
    HPKV."""
    side = vllm_side
    side.add("a", PROMPT)
    side.run("a")
    assert side.scheduler.reset_prefix_cache()
    connector = side.scheduler.connector

    request = side.add("b", PROMPT, prompt_logprobs=1)

    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    assert node.client("probe").stats().leases == 0


def test_unregistering_the_kv_caches_waits_for_the_saves_still_reading_them(vllm_side):
    """Before sleep mode frees the KV cache, vLLM 0.33 on has the connector unregister it: a save
    still copying from it (asynchronous saves, on an accelerator) must be done first."""
    side = vllm_side
    worker = side.worker._worker
    worker.async_saves = True
    gate, copying = threading.Event(), threading.Event()
    copy = worker.copiers[0].save
    worker.copiers[0].save = lambda *args: (copying.set(), gate.wait(10), copy(*args))
    worker._forward_done_event = lambda: None  # the CPU has no events: the copy may start at once
    side.add("a", PROMPT)
    side.step()
    assert copying.wait(10)

    unregistered = threading.Event()
    threading.Thread(target=lambda: (side.worker.unregister_kv_caches(), unregistered.set()), daemon=True).start()
    assert not unregistered.wait(0.3)  # the save still reads the KV cache
    gate.set()
    assert unregistered.wait(10)
    side.worker.restore_kv_caches()  # after wake-up: the same tensors, nothing to redo


@pytest.mark.parametrize("vllm_side", [64], indirect=True)
def test_a_sliding_window_models_hit_loads_asynchronously_every_full_block_and_the_window(vllm_side):
    """Layer 1 reads a 64-token window (its own KV cache group): vLLM gives it no memory for
    blocks that left the window, so HPKV saves each of its blocks while the window holds it.
    A hit of a hybrid model loads asynchronously: request b waits a step while the workers
    load layer 0's 4 blocks and layer 1's 2 window blocks, then runs with all 4 computed."""
    side = vllm_side
    side.add("a", PROMPT)
    side.run("a")
    assert side.scheduler.reset_prefix_cache()
    for cache in side.caches.values():
        cache.zero_()

    side.add("b", PROMPT)
    first = side.step()  # the load: b waits for it
    assert not first.num_scheduled_tokens
    (full, window) = side.scheduler.kv_cache_manager.get_block_ids("b")
    out = side.step()

    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 4 * BS
    assert side.block_bytes(full[:4], LAYER_NAMES[:1]) == expected_bytes(PROMPT, range(4), [0])
    assert side.block_bytes(window[2:4], LAYER_NAMES[1:]) == expected_bytes(PROMPT, range(2, 4), [1])
