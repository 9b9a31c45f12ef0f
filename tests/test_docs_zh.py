"""The Chinese pages (README.zh-CN.md, docs/zh/) name only what exists: every HPKV key is a
configuration key, every `hpkv` command and flag is one of the CLI's, every flag of the vLLM and
SGLang launch commands is one their parsers take, and the one vLLM flag they say to drop is one
vLLM rejects. (docs/configuration.md is checked the same way in test_config.py.)"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hpkv.cli import main
from hpkv.config import KEYS
from hpkv.integrations.vllm import optout

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.zh-CN.md", *sorted((REPO / "docs" / "zh").glob("*.md"))]
KEY = re.compile(r"\b(?:HPKV_[A-Z_]+|VLLM_HPKV_[A-Z_]+|VLLM_ENABLE_HPKV)\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
DROPPED_VLLM_FLAG = "--disable-log-requests"  # in the original document; vLLM 0.32 rejects it


def _code(page: Path) -> tuple[list[str], list[str]]:
    """(inline code spans, fenced blocks) of a page."""
    text = page.read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose), blocks


def _commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


def test_there_are_chinese_pages_and_the_readme_links_them():
    assert len(PAGES) >= 2
    assert "README.zh-CN.md" in (REPO / "README.md").read_text()
    assert "docs/zh/quickstart.md" in (REPO / "README.zh-CN.md").read_text()


def test_every_hpkv_key_the_chinese_pages_name_exists():
    known = {spec.name for spec in KEYS}
    for page in PAGES:
        named = set(KEY.findall(page.read_text()))
        assert named and named <= known, (page.name, named - known)


def test_every_hpkv_command_and_flag_the_chinese_pages_name_exists():
    seen = set()
    for page in PAGES:
        spans, blocks = _code(page)
        for text in spans + [c for b in blocks for c in _commands(b)]:
            for found in re.finditer(r"\bhpkv ([a-z]+)\b(.*)", text):
                command = main.commands.get(found.group(1))
                assert command is not None, (page.name, text)
                opts = {o for p in command.params for o in getattr(p, "opts", [])}
                flags = set(FLAG.findall(found.group(2)))
                assert flags <= opts, (page.name, text, flags - opts)
                seen.add(found.group(1))
    assert {"config", "demo", "server", "status", "clear", "doctor"} <= seen


def test_the_per_request_keys_the_chinese_pages_name_are_the_connectors():
    text = (REPO / "docs" / "zh" / "quickstart.md").read_text()
    assert set(re.findall(r'"(hpkv_[a-z]+)"', text)) == {optout.LOAD, optout.SAVE}


def _engine_flags(word: str) -> set[str]:
    flags = set()
    for page in PAGES:
        for block in _code(page)[1]:
            for command in _commands(block):
                if word in command:
                    flags |= set(FLAG.findall(command.split("'")[0] + " ".join(command.split("'")[2::2])))
    return flags


@pytest.mark.vllm
def test_the_vllm_flags_the_chinese_pages_name_are_vllms_and_the_dropped_one_is_rejected():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    accepted = set(parser._option_string_actions)
    flags = _engine_flags("vllm serve") | _engine_flags("api_server")
    assert {"--kv-transfer-config", "--block-size", "--enable-prefix-caching"} <= flags
    assert flags <= accepted, flags - accepted
    assert DROPPED_VLLM_FLAG not in accepted
    assert any(DROPPED_VLLM_FLAG in span for page in PAGES for span in _code(page)[0])


def test_the_sglang_flags_the_chinese_pages_name_are_sglangs_or_hpkvs():
    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    from hpkv.integrations.sglang.flag import FLAG as ENABLE_CT_HPKV

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    accepted = set(parser._option_string_actions) | {ENABLE_CT_HPKV}
    flags = _engine_flags("sglang serve")
    assert {ENABLE_CT_HPKV, "--page-size", "--device"} <= flags
    assert flags <= accepted, flags - accepted
