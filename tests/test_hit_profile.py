"""bench.hit_profile splits a hit's TTFT into HPKV's part and vLLM's forward pass, from the
spans its shim writes in the engine's processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import bench.hit_profile as hp
from bench.harness.engine import engine_shim


def test_a_dram_hit_is_split_into_lease_load_copy_and_forward():
    sent = 100.0
    spans = sorted(
        [
            (99.990, 99.9903, "execute_model"),  # the untimed request's empty last step: before the send
            (100.001, 100.0013, "execute_model"),  # an empty step after the send: not the prompt's
            (100.010, 100.012, "_lease"),
            (100.014, 100.015, "execute_model"),  # still empty (1 ms)
            (100.020, 100.120, "execute_model"),  # the prompt's step: 100 ms, of which 30 ms load
            (100.021, 100.051, "_load"),
            (100.022, 100.049, "load"),
            (100.200, 100.220, "execute_model"),  # a decode step, after the first token
        ]
    )

    hit = hp.breakdown(spans, "dram", 0, sent, 0.150, {"host": 8192.0})

    assert round(hit.scheduler_lease_ms, 3) == 2.0
    assert round(hit.worker_load_ms, 3) == 30.0
    assert round(hit.copy_ms, 3) == 27.0
    assert round(hit.step_ms, 3) == 100.0
    assert round(hit.forward_ms, 3) == 70.0
    assert hit.ttft_ms == 150.0


def test_an_in_engine_hit_has_no_hpkv_part_and_the_traces_are_read_back(tmp_path):
    (tmp_path / "trace-1.log").write_text("10.000000 10.040000 execute_model\n")
    (tmp_path / "trace-2.log").write_text("9.000000 9.100000 _lease\n")

    spans = hp.read_traces(tmp_path)
    hit = hp.breakdown(spans, "in-engine", 3, 9.95, 0.1, {})  # the lease at 9.0 is not this request's

    assert spans[0] == (9.0, 9.1, "_lease")
    assert hit.scheduler_lease_ms is None and hit.worker_load_ms is None
    assert round(hit.step_ms, 3) == round(hit.forward_ms, 3) == 40.0
    medians = hp.summarize([hit])
    assert round(medians["in-engine"]["forward_ms"], 3) == 40.0 and medians["dram"]["ttft_ms"] is None


@pytest.mark.vllm
@pytest.mark.parametrize("spin", [None, "0"])
def test_benchmark_engines_wait_without_vllms_queue_spin_when_asked(tmp_path, monkeypatch, spin):
    """With HPKV_BENCH_VLLM_SPIN=0 the sitecustomize every benchmark engine gets sets vLLM's own
    SpinCondition to wait without spinning (by default it keeps vLLM's 1 s); either way the
    caller's shim (hit_profile's) runs, and the caller's PYTHONPATH stays behind it."""
    if spin:
        monkeypatch.setenv("HPKV_BENCH_VLLM_SPIN", spin)
    else:
        monkeypatch.delenv("HPKV_BENCH_VLLM_SPIN", raising=False)
    marker = tmp_path / "marker"
    env = engine_shim({"PYTHONPATH": "/elsewhere"}, tmp_path / "shim", f"open({str(marker)!r}, 'w').close()")
    assert env["PYTHONPATH"] == f"{tmp_path / 'shim'}{os.pathsep}/elsewhere"
    probe = (
        "import inspect\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "print(inspect.signature(SpinCondition.__init__).parameters['busy_loop_s'].default)\n"
        "print(SpinCondition.__init__.__defaults__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": env["PYTHONPATH"]},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[1] == ("(0.0,)" if spin == "0" else "(1,)")
    assert marker.exists()  # the caller's shim ran too
