"""The `hpkv` command line.

Owns the click group `main` and the operator commands. Every `HpkvError` raised under any
command is printed once, here, as `error: <message>` on stderr with exit code 2 and no
traceback; commands just raise. Commands hold no cache logic: they load settings and call into
the library.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hpkv import __version__, configview
from hpkv.cluster import commands as cluster_commands
from hpkv.config import Settings, load_settings, parse_size
from hpkv.errors import HpkvError

# Exit status for a problem the user must fix (bad config, paths, space); click uses 2 for
# usage errors, which are the same kind of thing.
EXIT_USER_ERROR = 2


class _Group(click.Group):
    """A group that turns HpkvError from any subcommand into a one-line message."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except HpkvError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(EXIT_USER_ERROR)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="hpkv")
def main() -> None:
    """HPKV: a tiered KV cache (shared DRAM pool + persistent storage) for LLM engines."""


# --- hpkv config ---------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def config(as_json: bool) -> None:
    """Show every setting, its value and where it came from (file, env, default)."""
    settings = load_settings()
    if as_json:
        click.echo(configview.as_json(settings))
    else:
        configview.print_table(settings)


# --- hpkv bench ----------------------------------------------------------------------------


def _size_option(text: str, option: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(
            f"{text!r}: {exc}; use bytes or a number with k, m, g or t", param_hint=option
        ) from None


@main.command()
@click.option("--sizes", default="64k,256k,1m,4m", show_default=True, help="Entry sizes, comma-separated.")
@click.option("--total", default="256m", show_default=True, help="Bytes moved per entry size and round.")
@click.option(
    "--lookup-keys",
    default=1_000_000,
    show_default=True,
    type=click.IntRange(min=4096),
    help="Keys the store holds for the lookup benchmark.",
)
@click.option(
    "--storage-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Where the storage temporaries go (default: the current directory).",
)
@click.option(
    "--pool-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Where the pool temporaries go (default: /dev/shm).",
)
@click.option("--io-threads", default=8, show_default=True, type=click.IntRange(1, 256), help="Storage I/O threads.")
@click.option(
    "--reps",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Timed rounds per throughput figure (the best is reported).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench(
    sizes: str,
    total: str,
    lookup_keys: int,
    storage_dir: Path | None,
    pool_dir: Path | None,
    io_threads: int,
    reps: int,
    as_json: bool,
) -> None:
    """Measure DRAM and storage throughput and lookup time against this machine's limits."""
    from hpkv.benchmark import BenchConfig, report, run  # numpy and the store: only for this command

    entry_sizes = tuple(_size_option(s, "--sizes") for s in sizes.split(",") if s.strip())
    try:
        bench_config = BenchConfig(
            entry_sizes=entry_sizes,
            total_bytes=_size_option(total, "--total"),
            num_lookup_keys=lookup_keys,
            pool_parent=pool_dir,
            storage_parent=storage_dir,
            io_threads=io_threads,
            reps=reps,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    progress = Console(stderr=True, highlight=False)
    result = run(bench_config, lambda message: progress.print(f"measuring {message}..."))
    if as_json:
        click.echo(report.to_json(result))
    else:
        report.print_table(result, Console(width=None if sys.stdout.isatty() else 1000, highlight=False))


# --- hpkv server, status, clear, doctor -------------------------------------------------------
# The server's modules (and doctor's probes) are imported inside the commands: `hpkv --help`
# and `hpkv config` stay quick and need none of them.

# `status` finding no server is an answer, not a mistake to fix: exit 1, as `systemctl status` does.
EXIT_NO_SERVER = 1
EXIT_DOCTOR_FAILED = 1
_VERDICT_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}


def _stdout_console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 1000, highlight=False)


def _connect(settings: Settings):
    """A connected `Client` of the running server, or None when no server answers. Never starts one."""
    from hpkv.server.autostart import ServerUnavailable
    from hpkv.server.client import Client

    client = Client(settings.pool.dir, kind="cli", autostart=False, trusted_uids=settings.server_allow_uids)
    try:
        client.connect()
    except ServerUnavailable:
        return None
    return client


def _no_server_message(settings: Settings) -> str:
    from hpkv.server.autostart import MANAGED_NAME
    from hpkv.server.protocol import SOCKET_NAME

    directory = Path(settings.pool.dir)
    how = "it starts with the first engine process, or run `hpkv server`"
    if (directory / MANAGED_NAME).exists():
        how = f"{directory / MANAGED_NAME}: a managed one, not auto-started: `systemctl start hpkv-server`"
    return f"no HPKV server is running on {directory / SOCKET_NAME}; {how}"


@main.command("server")
@click.option("--auto", is_flag=True, hidden=True, help="Exit after the last client leaves.")
@click.pass_context
def server_command(ctx: click.Context, auto: bool) -> None:
    """Run the node's HPKV Server in the foreground until SIGTERM or Ctrl-C.

    A server started this way stays up across engine restarts, so the DRAM tier stays warm
    (an auto-started one exits after its last engine leaves). Settings are read once, now. Under
    systemd it marks its directory hpkv.managed, which keeps engines from auto-starting a server
    there while it is down.
    """
    from hpkv.server.daemon import serve

    ctx.exit(serve(auto=auto))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the server's raw stats as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the running server: tiers, namespaces with hit rates, clients. Never starts one."""
    from hpkv.status import STATUS_NAMESPACES, print_status

    settings = load_settings()
    client = _connect(settings)
    if client is None:
        click.echo(_no_server_message(settings), err=True)
        ctx.exit(EXIT_NO_SERVER)
    with client:  # the table shows the busiest namespaces; JSON has them all
        stats = client.all_stats() if as_json else client.stats(max_namespaces=STATUS_NAMESPACES, busiest=True)
    if as_json:
        import msgspec

        click.echo(json.dumps(msgspec.to_builtins(stats), indent=2))
    else:
        print_status(stats, _stdout_console())


def _ns_words(ns: str | None) -> str:
    return f" of namespace {ns}" if ns else ""


def _clear_storage_directly(settings: Settings, ns: str | None) -> None:
    from hpkv.clearing import clear_storage_directly

    num = clear_storage_directly(settings, ns)
    if num is None:
        click.echo(f"storage: {settings.storage.path} does not exist; nothing to remove")
    else:
        click.echo(f"storage: removed {num} entry files{_ns_words(ns)} from {settings.storage.path}")


@main.command()
@click.option("--memory", "dram", is_flag=True, help="Drop the entries in DRAM and the cluster tier (needs a server).")
@click.option(
    "--storage", is_flag=True, help="Delete the entry files in the storage directory (works without a server)."
)
@click.option(
    "--namespace", "namespace", metavar="NS", help="Only this namespace: its id, or a prefix as `hpkv status` shows it."
)
@click.option(
    "--model",
    "model",
    metavar="NAME",
    help="Every namespace of this model (the path or hub id it was served from, or its HPKV_MODEL_ID); "
    "memory and storage unless --memory or --storage says which.",
)
def clear(dram: bool, storage: bool, namespace: str | None, model: str | None) -> None:
    """Remove cached KV. With neither --memory nor --storage, clears memory (the DRAM pool) only.

    This is the DRAM clear endpoint: after it, the next request can only hit storage.
    """
    from hpkv.clearing import model_namespaces, resolve_ns, storage_namespaces

    if model is not None and namespace is not None:
        raise click.UsageError("give --model or --namespace, not both")
    if model is not None and not (dram or storage):
        dram = storage = True
    dram = dram or not storage
    settings = load_settings()
    storage_path = Path(settings.storage.path)
    client = _connect(settings)
    stats = client.all_stats() if client is not None else None
    descs = {ns: n.desc for ns, n in stats.namespaces.items()} if stats is not None else {}
    if model is not None:
        targets: list[str | None] = list(model_namespaces(model, descs, storage_path))
        if not targets:
            click.echo(f"no namespace of model {model} in the DRAM pool or in {storage_path}; nothing to remove")
    else:
        targets = [resolve_ns(namespace, list(descs) + storage_namespaces(storage_path))]
    try:
        for ns in targets:
            _clear_one(settings, client, stats, dram, storage, ns)
    finally:
        if client is not None:
            client.close()


def _clear_one(settings: Settings, client, stats, dram: bool, storage: bool, ns: str | None) -> None:
    from hpkv.server.protocol import SOCKET_NAME

    if client is None:
        if dram:
            click.echo(
                f"memory: no HPKV server is running on {Path(settings.pool.dir) / SOCKET_NAME}, so the "
                "DRAM pool is already empty (it lives only as long as a server)"
            )
        if storage:
            _clear_storage_directly(settings, ns)
        return
    server_has_storage = stats.storage is not None
    cleared = client.clear(dram=dram, storage=storage and server_has_storage, ns=ns)
    if dram:
        click.echo(
            f"memory: dropped {cleared.dram} entries{_ns_words(ns)} from the DRAM pool of the server "
            f"(pid {stats.server.pid})"
        )
    if storage and server_has_storage:
        click.echo(f"storage: removed {cleared.storage} entry files{_ns_words(ns)} from {settings.storage.path}")
    elif storage:
        _clear_storage_directly(settings, ns)  # the server runs with its storage tier off


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check this node's setup: mounts, permissions, free space, memlock, the server, hash stability.

    Exits 1 when a check fails; every problem comes with a fix.
    """
    from hpkv.doctor import Verdict, run_checks

    checks = run_checks()
    failed = sum(c.verdict is Verdict.FAIL for c in checks)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "checks": [
                        {"name": c.name, "verdict": c.verdict.value, "detail": c.detail, "fix": c.fix} for c in checks
                    ],
                    "failed": failed,
                },
                indent=2,
            )
        )
    else:
        table = Table(title="HPKV doctor")
        table.add_column("check", no_wrap=True)
        table.add_column("verdict", no_wrap=True)
        table.add_column("detail")
        table.add_column("fix")
        for c in checks:
            table.add_row(
                Text(c.name), Text(c.verdict.value, style=_VERDICT_STYLE[c.verdict.value]), Text(c.detail), Text(c.fix)
            )
        console = _stdout_console()
        console.print(table)
        counts = {v.value: sum(c.verdict is v for c in checks) for v in Verdict}
        console.print(", ".join(f"{num} {name}" for name, num in counts.items()), markup=False)
    if failed:
        ctx.exit(EXIT_DOCTOR_FAILED)


# --- hpkv demo -------------------------------------------------------------------------------


@main.command()
@click.option(
    "--model",
    default=None,
    help="A model path to serve (default: build a tiny random model; needed for a real model on an accelerator).",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where the model, storage and logs go (default: a temporary directory).",
)
@click.option("--prompt-words", default=2000, show_default=True, help="Length of the long prompt.")
@click.option("--pool-size", default="1g", show_default=True, help="HPKV_KV_MEM_POOL_SIZE for the demo.")
@click.option(
    "--engine",
    type=click.Choice(["vllm", "sglang"]),
    default="vllm",
    show_default=True,
    help="The engine to walk the scenarios on (sglang: run where SGLang is installed; `make demo-sglang` on a CPU).",
)
def demo(model: str | None, workdir: Path | None, prompt_words: int, pool_size: str, engine: str) -> None:
    """Walk the quick-start scenarios on a real vLLM or SGLang: cold, DRAM hit, storage hit."""
    import tempfile

    from hpkv.demo.scenario import DemoConfig, has_accelerator, passed, run_demo
    from hpkv.demo.sglang_scenario import run_sglang_demo

    console = _stdout_console()
    if model is None and has_accelerator():
        console.print("an accelerator is present: pass --model PATH to run the walk on a real model")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="hpkv-demo-"))
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    console.print(f"HPKV demo in {workdir} ({name} log: {workdir / (engine + '.log')})")
    walk = run_sglang_demo if engine == "sglang" else run_demo
    steps = walk(
        DemoConfig(
            workdir=workdir,
            model=model,
            prompt_words=prompt_words,
            pool_size=pool_size,
            log=console.print,
            console=console,
        )
    )
    table = Table(title=f"HPKV quick-start scenarios on {name}")
    for column in ("step", "hit tier", "hit tokens", "TTFT (ms)", f"identical to {name}'s own prefix-cache hit"):
        table.add_column(column)
    for step in steps:
        tokens = "-" if step.num_files is not None else str(step.hit_tokens)
        table.add_row(step.name, step.tier, tokens, f"{step.ttft_ms:.0f}" if step.ttft_ms else "-", step.identical)
    console.print(table)
    if not passed(steps):
        console.print("[red]the demo did not show every documented hit with identical output[/red]")
        sys.exit(1)


main.add_command(cluster_commands.cluster)
