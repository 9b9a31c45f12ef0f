"""Stories about where each setting comes from and what a person sees when one is wrong."""

import os
from pathlib import Path

import pytest

from hpkv.config import KEYS, Source, load_settings, parse_size
from hpkv.errors import ConfigError

GIB = 1024**3


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


def env_with(home: Path, **variables: str) -> dict[str, str]:
    return {"HOME": str(home), **variables}


def write_config(path: Path, *lines: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def named_config(tmp_path: Path, home: Path, *lines: str, **variables: str):
    """A config file named by HPKV_CONFIG_FILE_PATH, and the env that names it."""
    path = write_config(tmp_path / "config.ini", *lines)
    return path, env_with(home, HPKV_CONFIG_FILE_PATH=str(path), **variables)


# --- precedence ---------------------------------------------------------------------------


def test_nothing_set_gives_the_documented_defaults(home):
    settings = load_settings(env_with(home))
    assert settings.config_file == home / ".config/hpkv/config.ini"
    assert settings.storage.path == home / ".cache/hpkv/storage"
    assert settings.pool == settings.pool.__class__(dir=Path(f"/dev/shm/hpkv-{os.geteuid()}"), size_bytes=8 * GIB)
    assert settings.token_threshold == 1204
    assert settings.enable_vllm is False
    assert settings.storage.enabled is True
    assert settings.storage.capacity_bytes is None
    assert settings.storage.write_budget_bytes is None  # unlimited
    assert settings.storage.fsync == "off"
    assert settings.storage.io_threads == 8
    assert settings.log_level == "info"
    assert (settings.metrics_port, settings.metrics_host) == (0, "127.0.0.1")
    assert settings.server_idle_exit_s == 10.0
    assert (settings.server_max_slot_share, settings.server_max_user_slot_share) == (0.75, 0.75)
    assert (settings.server_max_connections_per_uid, settings.server_connection_idle_s) == (256, 600.0)
    assert settings.server_allow_uids == ()
    assert all(s.source is Source.DEFAULT and s.where == "default" for s in settings.settings)
    assert settings.warnings == ()


def test_every_key_is_reported_once_in_table_order(home):
    settings = load_settings(env_with(home))
    assert [s.key for s in settings.settings] == [spec.name for spec in KEYS]


def test_the_file_beats_the_environment(tmp_path, home):
    path, env = named_config(tmp_path, home, "HPKV_KV_MEM_POOL_SIZE=16g", HPKV_KV_MEM_POOL_SIZE="2g")
    settings = load_settings(env)
    assert settings.pool.size_bytes == 16 * GIB
    setting = settings.source_of("HPKV_KV_MEM_POOL_SIZE")
    assert (setting.source, setting.where, setting.raw) == (Source.FILE, f"{path}:1", "16g")


def test_the_environment_is_used_when_the_file_lacks_the_key(tmp_path, home):
    _, env = named_config(tmp_path, home, "HPKV_KV_MEM_POOL_SIZE=16g", HPKV_IO_THREADS="3")
    settings = load_settings(env)
    assert settings.storage.io_threads == 3
    assert settings.source_of("HPKV_IO_THREADS").source is Source.ENV
    assert settings.source_of("HPKV_IO_THREADS").where == "env"


def test_the_default_is_used_when_neither_has_the_key(tmp_path, home):
    _, env = named_config(tmp_path, home, "HPKV_KV_MEM_POOL_SIZE=16g")
    settings = load_settings(env)
    assert settings.log_level == "info"
    assert settings.source_of("HPKV_LOG_LEVEL").source is Source.DEFAULT


def test_the_default_file_is_found_under_home(home):
    path = write_config(home / ".config/hpkv/config.ini", "HPKV_LOG_LEVEL=debug")
    settings = load_settings(env_with(home))
    assert settings.config_file == path
    assert settings.log_level == "debug"
    assert settings.source_of("HPKV_LOG_LEVEL").where == f"{path}:1"
    assert settings.warnings == ()


def test_config_file_path_may_start_with_tilde(home):
    write_config(home / "my.ini", "HPKV_IO_THREADS=2")
    settings = load_settings(env_with(home, HPKV_CONFIG_FILE_PATH="~/my.ini"))
    assert settings.config_file == home / "my.ini"
    assert settings.storage.io_threads == 2
    assert settings.source_of("HPKV_CONFIG_FILE_PATH").source is Source.ENV


def test_an_empty_environment_variable_counts_as_unset(home):
    settings = load_settings(env_with(home, VLLM_ENABLE_HPKV="", HPKV_KV_MEM_POOL_SIZE=""))
    assert settings.enable_vllm is False
    assert settings.source_of("HPKV_KV_MEM_POOL_SIZE").source is Source.DEFAULT


def test_load_settings_reads_os_environ_by_default(monkeypatch, home):
    for name in list(os.environ):
        if name.startswith(("HPKV_", "VLLM_HPKV_", "VLLM_ENABLE_HPKV")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HPKV_METRICS_PORT", "9400")
    assert load_settings().metrics_port == 9400


# --- expansion and file format --------------------------------------------------------------


def test_tilde_and_variables_are_expanded_in_file_values(tmp_path, home):
    _, env = named_config(
        tmp_path,
        home,
        "HPKV_KV_STORAGE_PATH=~/.cache/hpkv/storage",
        "HPKV_SHARE_MEM_FILE_PATH=$RAMDIR/hpkv",
        "HPKV_METRICS_HOST=${BIND_HOST}",
        RAMDIR="/mnt/ram",
        BIND_HOST="0.0.0.0",
    )
    settings = load_settings(env)
    assert settings.storage.path == home / ".cache/hpkv/storage"
    assert settings.pool.dir == Path("/mnt/ram/hpkv")
    assert settings.metrics_host == "0.0.0.0"
    assert settings.source_of("HPKV_KV_STORAGE_PATH").raw == "~/.cache/hpkv/storage"


def test_paths_from_the_environment_are_expanded_and_made_absolute(home, tmp_path):
    settings = load_settings(env_with(home, HPKV_KV_STORAGE_PATH="~/kv", HPKV_SHARE_MEM_FILE_PATH="relative/shm"))
    assert settings.storage.path == home / "kv"
    assert settings.pool.dir == Path.cwd() / "relative/shm"


def test_a_file_without_a_section_and_one_with_a_section_read_the_same(tmp_path, home):
    plain = write_config(tmp_path / "plain.ini", "HPKV_IO_THREADS=5")
    sectioned = write_config(tmp_path / "sectioned.ini", "[hpkv]", "HPKV_IO_THREADS=5")
    for path in (plain, sectioned):
        settings = load_settings(env_with(home, HPKV_CONFIG_FILE_PATH=str(path)))
        assert settings.storage.io_threads == 5
    assert (
        load_settings(env_with(home, HPKV_CONFIG_FILE_PATH=str(sectioned))).source_of("HPKV_IO_THREADS").where
        == f"{sectioned}:2"
    )


def test_quotes_export_comments_and_blank_lines_are_accepted(tmp_path, home):
    _, env = named_config(
        tmp_path,
        home,
        "# HPKV settings",
        "; another comment",
        "",
        'export HPKV_KV_STORAGE_PATH="/mnt/hpkv/storage"',
        "  HPKV_KV_MEM_POOL_SIZE = '1.5g'  ",
        "export VLLM_ENABLE_HPKV=1",
    )
    settings = load_settings(env)
    assert settings.storage.path == Path("/mnt/hpkv/storage")
    assert settings.pool.size_bytes == 3 * GIB // 2
    assert settings.enable_vllm is True


def test_a_key_set_twice_in_the_file_keeps_the_last_and_warns(tmp_path, home):
    path, env = named_config(tmp_path, home, "HPKV_IO_THREADS=2", "HPKV_IO_THREADS=4")
    settings = load_settings(env)
    assert settings.storage.io_threads == 4
    assert any(f"{path}:2 wins over {path}:1" in w for w in settings.warnings)


def test_every_kind_of_value_parses_from_the_file(tmp_path, home):
    _, env = named_config(
        tmp_path,
        home,
        "VLLM_HPKV_TOKEN_THRESHOLD=auto",
        "HPKV_KV_STORAGE_ENABLE=off",
        "HPKV_KV_STORAGE_SIZE=2T",
        "HPKV_KV_STORAGE_FSYNC=FULL",
        "HPKV_LOG_LEVEL=Warning",
        "HPKV_METRICS_PORT=65535",
        "HPKV_SERVER_IDLE_EXIT_S=2.5",
        "HPKV_KV_STORAGE_WRITE_BUDGET=3.5t",
    )
    settings = load_settings(env)
    assert settings.token_threshold is None
    assert settings.storage.enabled is False
    assert settings.storage.capacity_bytes == 2 * 1024**4
    assert settings.storage.fsync == "full"
    assert settings.log_level == "warning"
    assert settings.metrics_port == 65535
    assert settings.server_idle_exit_s == 2.5
    assert settings.storage.write_budget_bytes == 7 * 1024**4 // 2


# --- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size_bytes",
    [
        ("4096", 4096),
        ("8g", 8 * GIB),
        ("8G", 8 * GIB),
        ("8gb", 8 * GIB),
        ("8GiB", 8 * GIB),
        ("512m", 512 * 1024**2),
        ("1.5g", 3 * GIB // 2),
        (" 1t ", 1024**4),
        ("4k", 4096),
    ],
)
def test_sizes_are_binary_multiples(text, size_bytes):
    assert parse_size(text) == size_bytes


@pytest.mark.parametrize(
    "text, reason",
    [
        ("8x", "not a size"),
        ("", "not a size"),
        ("g", "not a size"),
        ("-1g", "not a size"),
        ("0", "greater than 0"),
        ("0g", "greater than 0"),
        ("1.5", "whole number"),
    ],
)
def test_bad_sizes_raise_value_error_with_a_short_reason(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_size(text)


# --- errors a person must fix ---------------------------------------------------------------


def assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_bad_size_in_the_environment_names_key_value_source_and_syntax(home):
    with pytest.raises(ConfigError) as caught:
        load_settings(env_with(home, HPKV_KV_MEM_POOL_SIZE="8x"))
    assert str(caught.value) == (
        "HPKV_KV_MEM_POOL_SIZE='8x' (from environment): not a size; "
        "use bytes or a number with k, m, g or t (e.g. 8g, 512m, 1t)"
    )


@pytest.mark.parametrize(
    "key, value, accepted",
    [
        ("HPKV_KV_MEM_POOL_SIZE", "lots", "bytes or a number with k, m, g or t"),
        ("HPKV_KV_STORAGE_SIZE", "most", "'auto', or a size: bytes"),
        ("HPKV_KV_STORAGE_WRITE_BUDGET", "little", "'unlimited', or a size per day: bytes"),
        ("VLLM_ENABLE_HPKV", "maybe", "1/0, true/false, yes/no or on/off"),
        ("HPKV_IO_THREADS", "eight", "an integer from 1 to 256"),
        ("HPKV_IO_THREADS", "0", "an integer from 1 to 256"),
        ("VLLM_HPKV_TOKEN_THRESHOLD", "-5", "an integer >= 0 or 'auto'"),
        ("HPKV_KV_STORAGE_FSYNC", "always", "off, data or full"),
        ("HPKV_LOG_LEVEL", "loud", "debug, info, warning or error"),
        ("HPKV_METRICS_PORT", "70000", "an integer from 0 to 65535"),
        ("HPKV_SERVER_IDLE_EXIT_S", "soon", "a number of seconds >= 0"),
    ],
)
def test_a_bad_value_in_the_file_names_key_value_file_line_and_accepted(tmp_path, home, key, value, accepted):
    path, env = named_config(tmp_path, home, "[hpkv]", f"{key}={value}", **{key: "ignored"})
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    assert_names(str(caught.value), f"{key}={value!r}", f"(from config file {path}:2)", f"use {accepted}")


def test_a_bad_value_shows_what_it_expanded_to(tmp_path, home):
    _, env = named_config(tmp_path, home, "HPKV_KV_MEM_POOL_SIZE=$POOL", POOL="huge")
    with pytest.raises(ConfigError, match=r"'\$POOL' \(expanded to 'huge'\)"):
        load_settings(env)


def test_an_unknown_key_in_the_file_suggests_the_near_one(tmp_path, home):
    path, env = named_config(tmp_path, home, "# pool", "HPKV_KV_MEM_POOL_SZIE=8g")
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    assert_names(str(caught.value), "'HPKV_KV_MEM_POOL_SZIE'", f"{path}:2", "did you mean HPKV_KV_MEM_POOL_SIZE?")


def test_a_byte_order_mark_from_an_editor_is_not_part_of_the_first_key(tmp_path, home):
    path = tmp_path / "config.ini"
    path.write_bytes("HPKV_KV_MEM_POOL_SIZE=16g\n".encode("utf-8-sig"))
    settings = load_settings(env_with(home, HPKV_CONFIG_FILE_PATH=str(path)))
    assert settings.pool.size_bytes == 16 * GIB


def test_the_benchmarks_own_switches_are_not_called_unknown_settings(home):
    settings = load_settings(env_with(home, HPKV_BENCH_VLLM_SPIN="0", HPKV_KV_MEM_POOL_SZIE="8g"))
    assert [w.split()[2] for w in settings.warnings] == ["HPKV_KV_MEM_POOL_SZIE"]


def test_a_lowercase_key_is_unknown_but_the_suggestion_finds_it(tmp_path, home):
    _, env = named_config(tmp_path, home, "hpkv_log_level=debug")
    with pytest.raises(ConfigError, match="did you mean HPKV_LOG_LEVEL"):
        load_settings(env)


def test_an_unknown_key_far_from_any_lists_the_known_keys(tmp_path, home):
    _, env = named_config(tmp_path, home, "CUDA_VISIBLE_DEVICES=0")
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    assert_names(str(caught.value), "known keys: HPKV_CONFIG_FILE_PATH", "HPKV_IO_THREADS")


def test_the_config_file_path_cannot_be_set_inside_the_file(tmp_path, home):
    path, env = named_config(tmp_path, home, "HPKV_CONFIG_FILE_PATH=/etc/other.ini")
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    assert_names(str(caught.value), "HPKV_CONFIG_FILE_PATH", f"{path}:1", "set it in the environment")


def test_a_line_that_is_not_key_equals_value_names_file_and_line(tmp_path, home):
    path, env = named_config(tmp_path, home, "HPKV_IO_THREADS=4", "pool size is 8g")
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    assert_names(str(caught.value), f"{path}:2", "'pool size is 8g'", "KEY=VALUE")


def test_a_config_file_that_is_a_directory_is_an_error_with_the_fix(tmp_path, home):
    (tmp_path / "conf.d").mkdir()
    with pytest.raises(ConfigError) as caught:
        load_settings(env_with(home, HPKV_CONFIG_FILE_PATH=str(tmp_path / "conf.d")))
    assert_names(str(caught.value), str(tmp_path / "conf.d"), "HPKV_CONFIG_FILE_PATH")


def test_a_config_file_under_a_regular_file_is_an_error(tmp_path, home):
    (tmp_path / "notes.txt").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot read config file .*notes.txt/config.ini"):
        load_settings(env_with(home, HPKV_CONFIG_FILE_PATH=str(tmp_path / "notes.txt/config.ini")))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_config_file_is_an_error_with_the_fix(tmp_path, home):
    path, env = named_config(tmp_path, home, "HPKV_IO_THREADS=4")
    path.chmod(0)
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    assert_names(str(caught.value), str(path), "Permission denied", "readable")


def test_a_config_file_that_is_not_text_is_an_error(tmp_path, home):
    path = tmp_path / "config.ini"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(env_with(home, HPKV_CONFIG_FILE_PATH=str(path)))


# --- warnings -------------------------------------------------------------------------------


def test_a_missing_default_file_is_silent(home):
    assert load_settings(env_with(home)).warnings == ()


def test_a_missing_named_file_is_a_warning_not_an_error(tmp_path, home):
    missing = tmp_path / "nope.ini"
    settings = load_settings(env_with(home, HPKV_CONFIG_FILE_PATH=str(missing), HPKV_IO_THREADS="2"))
    assert settings.storage.io_threads == 2
    assert settings.warnings == (
        f"config file {missing} (named by HPKV_CONFIG_FILE_PATH) does not exist; using the environment and defaults",
    )


def test_an_unknown_hpkv_variable_in_the_environment_is_a_warning(home):
    settings = load_settings(env_with(home, HPKV_KV_MEM_POOL_SZE="8g", VLLM_HPKV_FOO="1", HPKVISH="1", VLLM_USE_V1="1"))
    assert settings.pool.size_bytes == 8 * GIB
    assert len(settings.warnings) == 2
    assert "HPKV_KV_MEM_POOL_SZE" in settings.warnings[0]
    assert "did you mean HPKV_KV_MEM_POOL_SIZE?" in settings.warnings[0]
    assert "VLLM_HPKV_FOO" in settings.warnings[1]


def test_source_of_an_unknown_key_is_a_bug(home):
    with pytest.raises(KeyError):
        load_settings(env_with(home)).source_of("HPKV_NOPE")


@pytest.mark.parametrize(
    "text",
    [
        "1_002",  # int() takes it
        "\u0661\u0660\u0660\u0662",  # Arabic-Indic 1002: int() takes it
        "4294967295",  # (uid_t)-1: no user's
        "4294967296",
        "+1002",
        "-1",
        "1002.0",
        "1002 1003",
    ],
)
def test_allow_uids_takes_ascii_digits_and_valid_uids_only(home, text):
    with pytest.raises(ConfigError, match="HPKV_SERVER_ALLOW_UIDS.*not a user id"):
        load_settings(env_with(home, HPKV_SERVER_ALLOW_UIDS=text))


def test_allow_uids_takes_a_list_with_spaces(home):
    settings = load_settings(env_with(home, HPKV_SERVER_ALLOW_UIDS="0, 1002,4294967294,"))
    assert settings.server_allow_uids == (0, 1002, 4294967294)


def test_the_docs_list_every_key_with_its_default():
    docs = (Path(__file__).parents[1] / "docs/configuration.md").read_text()
    for spec in KEYS:
        assert f"| `{spec.name}` | `{spec.default}` |" in docs, spec.name
