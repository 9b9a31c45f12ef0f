"""Stories about `hpkv config` and how the command line reports a problem."""

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hpkv import __version__
from hpkv.cli import main
from hpkv.errors import StorageError

HPKV_SCRIPT = Path(sys.executable).parent / "hpkv"


def clean_env(home: Path, **variables: str) -> dict[str, str]:
    """The current environment without any HPKV setting, HOME moved, plus `variables`."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("HPKV_", "VLLM_HPKV_", "VLLM_ENABLE_HPKV"))
    }
    return {**env, "HOME": str(home), **variables}


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    for name in list(os.environ):
        if name.startswith(("HPKV_", "VLLM_HPKV_", "VLLM_ENABLE_HPKV")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    return home


def write_config(path: Path, *lines: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_config_shows_every_key_with_value_and_source(tmp_path, home):
    path = write_config(home / ".config/hpkv/config.ini", "[hpkv]", "HPKV_KV_MEM_POOL_SIZE=16g")
    result = CliRunner().invoke(main, ["config"], env={"HPKV_IO_THREADS": "4"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    pool_line = next(line for line in lines if "HPKV_KV_MEM_POOL_SIZE" in line)
    assert "16 GiB" in pool_line and f"file {path}:2" in pool_line
    threads_line = next(line for line in lines if "HPKV_IO_THREADS" in line)
    assert "4" in threads_line and "env" in threads_line
    fsync_line = next(line for line in lines if "HPKV_KV_STORAGE_FSYNC" in line)
    assert "off" in fsync_line and "default" in fsync_line
    assert "Durability" in fsync_line


def test_config_prints_warnings_below_the_table(home):
    result = CliRunner().invoke(main, ["config"], env={"HPKV_IO_THRADS": "4"})
    assert result.exit_code == 0
    tail = result.stdout.rstrip().splitlines()[-1]
    assert tail.startswith("warning: environment variable HPKV_IO_THRADS")
    assert "did you mean HPKV_IO_THREADS?" in tail


def test_config_json_gives_value_source_and_where(tmp_path, home):
    path = write_config(tmp_path / "c.ini", "HPKV_KV_STORAGE_PATH=~/kv")
    result = CliRunner().invoke(
        main, ["config", "--json"], env={"HPKV_CONFIG_FILE_PATH": str(path), "VLLM_ENABLE_HPKV": "yes"}
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    settings = document["settings"]
    assert settings["HPKV_KV_STORAGE_PATH"] == {"value": str(home / "kv"), "source": "file", "where": f"{path}:1"}
    assert settings["VLLM_ENABLE_HPKV"] == {"value": True, "source": "env", "where": "env"}
    assert settings["HPKV_KV_STORAGE_SIZE"] == {"value": "auto", "source": "default", "where": "default"}
    assert settings["HPKV_KV_STORAGE_WRITE_BUDGET"]["value"] == "unlimited"
    assert settings["HPKV_KV_MEM_POOL_SIZE"]["value"] == 8 * 1024**3
    assert document["warnings"] == []


def test_a_bad_value_is_one_error_line_and_exit_2(home):
    result = CliRunner().invoke(main, ["config"], env={"HPKV_METRICS_PORT": "99999"})
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (
        "error: HPKV_METRICS_PORT='99999' (from environment): out of range; use an integer from 0 to 65535\n"
    )


def test_any_command_gets_the_same_error_handling(home):
    @main.command("explode-for-test")
    def explode() -> None:
        raise StorageError("/mnt/x is not writable; fix its permissions")

    try:
        result = CliRunner().invoke(main, ["explode-for-test"])
    finally:
        main.commands.pop("explode-for-test")
    assert result.exit_code == 2
    assert result.stderr == "error: /mnt/x is not writable; fix its permissions\n"
    assert isinstance(main, click.Group)


# --- the installed console script --------------------------------------------------------


def run_hpkv(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(HPKV_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_console_script_shows_sources(tmp_path):
    home = tmp_path / "home"
    path = write_config(home / ".config/hpkv/config.ini", "HPKV_LOG_LEVEL=debug")
    done = run_hpkv("config", env=clean_env(home, HPKV_METRICS_PORT="9400"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"file {path}:1" in next(line for line in lines if "HPKV_LOG_LEVEL" in line)
    assert "env" in next(line for line in lines if "HPKV_METRICS_PORT" in line)
    assert "default" in next(line for line in lines if "HPKV_IO_THREADS" in line)


def test_the_console_script_reports_a_bad_value_without_a_traceback(tmp_path):
    home = tmp_path / "home"
    path = write_config(home / ".config/hpkv/config.ini", "HPKV_KV_MEM_POOL_SIZE=8x")
    done = run_hpkv("config", env=clean_env(home))
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: HPKV_KV_MEM_POOL_SIZE='8x' (from config file {path}:1): not a size")
    assert "Traceback" not in done.stderr + done.stdout
