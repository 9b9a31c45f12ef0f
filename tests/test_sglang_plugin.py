"""The documented SGLang commands, parsed by SGLang itself: `--enable-ct-hpkv` becomes the
hierarchical cache with HPKV as its `dynamic` storage backend (zero-copy v1 interface), on GPU
and on Ascend, in either argument order, without touching a HiCache flag the user set; and
`sglang serve` / `python -m sglang.launch_server` find HPKV through their own plugin mechanisms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from helpers import sglang as su
from hpkv.integrations.sglang import flag

HPKV_BACKEND = {
    "backend_name": "ct_hpkv",
    "module_path": "hpkv.integrations.sglang.backend",
    "class_name": "HpkvStorage",
    "interface_v1": 1,
}


@pytest.fixture(autouse=True)
def hpkv_env(monkeypatch, shm_dir, tmp_path):
    """No user config file, documented defaults, fresh directories (nothing here starts a server)."""
    for name in [n for n in os.environ if n.startswith(("HPKV_", "VLLM_HPKV"))]:
        monkeypatch.delenv(name)
    env = {
        "HPKV_SHARE_MEM_FILE_PATH": str(shm_dir),
        "HPKV_KV_STORAGE_PATH": str(tmp_path / "storage"),
        "HPKV_CONFIG_FILE_PATH": str(tmp_path / "no-such-config.ini"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture(scope="module")
def entry_points_path(tmp_path_factory):
    added = su.entry_points_visible(tmp_path_factory.mktemp("entry-points"))
    yield added
    if added:
        sys.path.remove(added)


def parse(argv):
    """SGLang's real prepare_server_args on the rewritten command line."""
    from sglang.srt.server_args import prepare_server_args

    with su.root_logging_kept():
        return prepare_server_args(flag.rewrite_argv(argv))


def extra_config(args) -> dict:
    return json.loads(args.hicache_storage_backend_extra_config)


def test_the_documented_gpu_command_turns_on_hicache_with_hpkv_as_storage():
    args = parse(su.GPU_ARGV)
    assert args.model_path == su.MODEL and args.served_model_name == su.SERVED and args.page_size == 64
    assert args.enable_hierarchical_cache
    assert args.hicache_storage_backend == "dynamic"
    assert extra_config(args) == {**HPKV_BACKEND, "prefetch_threshold": 1204}  # the documented default
    assert args.hicache_mem_layout == "page_first" and args.hicache_io_backend == "kernel"


def test_the_original_documents_order_puts_the_model_path_back():
    args = parse(su.ORIGINAL_ORDER_ARGV)
    assert args.model_path == su.MODEL
    assert args.enable_hierarchical_cache and extra_config(args)["module_path"] == HPKV_BACKEND["module_path"]


def test_the_documented_ascend_command_parses_and_leaves_io_and_layout_to_sglang(monkeypatch):
    for name, value in su.ASCEND_ENV.items():
        monkeypatch.setenv(name, value)
    argv = flag.rewrite_argv(su.ASCEND_ARGV)
    assert "--hicache-mem-layout" not in argv and "--hicache-io-backend" not in argv
    args = parse(su.ASCEND_ARGV)
    assert args.device == "npu" and args.attention_backend == "ascend"
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert extra_config(args)["interface_v1"] == 1


@pytest.mark.parametrize("device", [["--device", "cpu"], ["--device=cpu"], ["--dev", "cpu"]])
def test_on_a_cpu_the_flag_picks_a_layout_and_io_backend_that_have_cpu_copies(device):
    """SGLang's `kernel` io backend (the one page_first needs) has no CPU build: it dies at the
    first backup. `direct` with page_first_direct keeps HPKV's two regions per page."""
    args = parse(su.GPU_ARGV + device)
    assert args.device == "cpu"
    assert (args.hicache_mem_layout, args.hicache_io_backend) == ("page_first_direct", "direct")
    assert args.hicache_storage_backend == "dynamic" and extra_config(args)["interface_v1"] == 1


@pytest.mark.parametrize(
    "given, expected",
    [
        (["--hicache-mem-layout", "layer_first"], ("layer_first", "direct")),
        (["--hicache-io-backend", "direct"], ("page_first", "direct")),  # SGLang's default, resolved by SGLang
        (["--hicache-io-backend", "kernel", "--hicache-mem-layout", "layer_first"], ("layer_first", "kernel")),
    ],
)
def test_on_a_cpu_a_layout_or_io_backend_the_user_gave_is_kept(given, expected):
    argv = flag.rewrite_argv(su.GPU_ARGV + ["--device", "cpu"] + given)
    assert argv.count("--hicache-mem-layout") <= 1 and argv.count("--hicache-io-backend") <= 1
    args = parse(su.GPU_ARGV + ["--device", "cpu"] + given)
    assert (args.hicache_mem_layout, args.hicache_io_backend) == expected
    assert flag.rewrite_argv(argv) == argv


def test_hicache_flags_the_user_gave_are_kept():
    argv = su.GPU_ARGV + [
        "--hicache-ratio",
        "3",
        "--hicache-mem-layout",
        "layer_first",
        "--hicache-write-policy",
        "write_back",
        "--hicache-storage-prefetch-policy",
        "best_effort",
        "--hicache-storage-backend-extra-config",
        '{"prefetch_threshold": 128, "mine": "x"}',
    ]
    args = parse(argv)
    assert (
        args.hicache_ratio,
        args.hicache_mem_layout,
        args.hicache_write_policy,
        args.hicache_storage_prefetch_policy,
    ) == (3.0, "layer_first", "write_back", "best_effort")
    assert extra_config(args) == {**HPKV_BACKEND, "prefetch_threshold": 128, "mine": "x"}


def test_hicache_flags_the_user_abbreviated_are_kept():
    """SGLang's parser takes any unique prefix of a flag: `--hicache-mem` is --hicache-mem-layout."""
    argv = su.GPU_ARGV + ["--hicache-mem", "layer_first", '--hicache-storage-backend-extra={"prefetch_threshold": 128}']
    args = parse(argv)
    assert args.hicache_mem_layout == "layer_first"
    assert extra_config(args) == {**HPKV_BACKEND, "prefetch_threshold": 128}
    assert flag.rewrite_argv(flag.rewrite_argv(argv)) == flag.rewrite_argv(argv)


@pytest.mark.parametrize("option", ["--config", "--conf"])  # argparse takes a unique prefix
def test_hicache_flags_from_sglangs_config_file_are_kept(tmp_path, option):
    config = tmp_path / "sglang.yaml"
    config.write_text("hicache-mem-layout: layer_first\nhicache-ratio: 3\n")
    args = parse(su.GPU_ARGV + [option, str(config)])
    assert (args.hicache_mem_layout, args.hicache_ratio) == ("layer_first", 3.0)
    assert args.hicache_storage_backend == "dynamic" and extra_config(args)["class_name"] == "HpkvStorage"


def test_another_storage_backend_the_user_chose_stays():
    args = parse(su.GPU_ARGV + ["--enable-hicache", "--hicache-storage-backend", "file"])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "file"
    assert args.hicache_storage_backend_extra_config is None


def test_the_rewrite_is_idempotent_and_needs_the_flag():
    once = flag.rewrite_argv(su.GPU_ARGV)
    assert flag.rewrite_argv(once) == once
    plain = ["--model-path", su.MODEL, "--page-size", "64"]
    assert flag.rewrite_argv(plain) == plain


def test_hpkv_token_threshold_from_the_config_file_becomes_sglangs_prefetch_threshold(monkeypatch, tmp_path):
    config = tmp_path / "config.ini"
    config.write_text("VLLM_HPKV_TOKEN_THRESHOLD=512\n")
    monkeypatch.setenv("HPKV_CONFIG_FILE_PATH", str(config))
    monkeypatch.setenv("VLLM_HPKV_TOKEN_THRESHOLD", "64")  # the file wins over the environment
    assert extra_config(parse(su.GPU_ARGV))["prefetch_threshold"] == 512


def test_auto_is_the_documented_threshold_under_sglang_and_the_log_says_why(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_HPKV_TOKEN_THRESHOLD", "auto")
    with caplog.at_level("WARNING", logger="hpkv.sglang"):
        assert extra_config(parse(su.GPU_ARGV))["prefetch_threshold"] == flag.DOCUMENTED_THRESHOLD
    assert "auto has no cost model under SGLang" in caplog.text


def test_a_bad_hpkv_config_is_a_command_line_error(monkeypatch, capsys):
    from hpkv.integrations.sglang import plugin

    monkeypatch.setenv("VLLM_HPKV_TOKEN_THRESHOLD", "lots")
    with pytest.raises(SystemExit) as exit_info:
        plugin._before_prepare_server_args(list(su.GPU_ARGV))
    assert exit_info.value.code == 2
    assert "VLLM_HPKV_TOKEN_THRESHOLD" in capsys.readouterr().err


def test_sglang_serve_detects_hpkvs_backend_only_with_the_flag(entry_points_path):
    from sglang.cli.serve import _create_backend_registry
    from sglang.cli.serve_backends import ServeRequest
    from sglang.cli.utils import try_get_model_path

    def detected(argv):
        request = ServeRequest(argv=tuple(argv), model_path=try_get_model_path(argv))
        return _create_backend_registry().auto_detect(request).name

    assert detected(su.GPU_ARGV) == "ct_hpkv"
    assert detected(["--model-path", su.MODEL, "--page-size", "64"]) == "llm"


def test_both_entry_points_launch_with_the_documented_command(entry_points_path, hpkv_env):
    """In a fresh process, as a user runs them: `sglang serve` (SGLang's console-script main,
    with run_server replaced by a recorder) and the module-level prepare_server_args of
    `python -m sglang.launch_server` after SGLang loads its plugins."""
    script = textwrap.dedent(f"""
        import json, logging, sys
        logging.basicConfig(level=logging.INFO)  # to see which serve backend SGLang selects
        import sglang.launch_server as launch_server
        from sglang.srt.plugins import load_plugins

        def show(how, args):
            print(json.dumps({{"how": how, "model": args.model_path, "hicache": args.enable_hierarchical_cache,
                              "backend": args.hicache_storage_backend,
                              "extra": args.hicache_storage_backend_extra_config}}), flush=True)

        launch_server.run_server = lambda args: show("sglang serve", args)
        sys.argv = ["sglang", "serve", *{su.ORIGINAL_ORDER_ARGV!r}]
        from sglang.cli.main import main
        main()
        load_plugins()  # what `python -m sglang.launch_server` does first; idempotent
        show("launch_server", launch_server.prepare_server_args({su.GPU_ARGV!r}))
    """)
    env = su.subprocess_env(entry_points_path, **hpkv_env)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [s["how"] for s in shown] == ["sglang serve", "launch_server"], done.stdout + done.stderr[-3000:]
    for s in shown:
        assert (s["model"], s["hicache"], s["backend"]) == (su.MODEL, True, "dynamic")
        assert json.loads(s["extra"])["class_name"] == "HpkvStorage"
    assert "Selected serve backend 'ct_hpkv'" in done.stderr


def test_pyproject_declares_the_entry_points():
    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["entry-points"]
    for group, eps in su.ENTRY_POINTS.items():
        assert declared.get(group, {}) == eps, f'pyproject.toml [project.entry-points."{group}"]'
