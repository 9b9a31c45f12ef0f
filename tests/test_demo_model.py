"""Building the demo's model (`demo/model.py`) leaves the terminal to the demo's own lines."""

from __future__ import annotations

import pytest

from hpkv.demo.model import build_model


@pytest.fixture
def progress_bars_on():
    """transformers' progress bars on, as on a user's machine; as they were afterwards."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    if not was_on:
        hf_logging.disable_progress_bar()


def test_building_the_model_writes_no_progress_bar_amid_the_demos_lines(tmp_path, capfd, progress_bars_on):
    build_model(tmp_path / "tiny-qwen2")

    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err
    assert (tmp_path / "tiny-qwen2" / "model.safetensors").exists()
