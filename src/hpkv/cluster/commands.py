"""`hpkv cluster start|stop`: this node's segment process, by hand (the server starts it by
itself when the cluster tier is on; `segment` says why it is a process of its own).

Primitives: the click group `cluster`, added to `hpkv` by `hpkv.cli`.
Must not know: the store, the server's protocol.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..config import load_settings
from ..pool.poolfile import prepare_directory
from ..units import human_bytes
from . import segment


@click.group()
def cluster() -> None:
    """This node's share of the cluster tier (HPKV_CLUSTER_ENABLE)."""


@cluster.command()
@click.option("--wait", "wait_s", default=30.0, show_default=True, help="Seconds to wait for its segment.")
def start(wait_s: float) -> None:
    """Start the process that contributes HPKV_CLUSTER_SEGMENT_SIZE of this node's memory to the
    cluster tier, unless it runs. It outlives servers and engines; `hpkv cluster stop` ends it."""
    settings = load_settings()
    config, run_dir = settings.cluster, Path(settings.pool.dir)
    if not config.enabled:
        raise click.ClickException("the cluster tier is off: set HPKV_CLUSTER_ENABLE=1 (see `hpkv config`)")
    if config.segment_bytes <= 0:
        raise click.ClickException("HPKV_CLUSTER_SEGMENT_SIZE is 0: this node contributes no memory")
    prepare_directory(run_dir)
    started = segment.ensure(config, run_dir)
    deadline = time.monotonic() + wait_s
    while (pid := segment.running(run_dir)) in (None, -1) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid in (None, -1):
        raise click.ClickException(
            f"no segment mounted after {wait_s:.0f} s: is the master at {config.master} up? "
            f"(its log: {run_dir / 'cluster-segment.log'}; `hpkv doctor` checks)"
        )
    verb = "started" if started else "already running"
    click.echo(f"segment process {pid} {verb}: {human_bytes(config.segment_bytes)} for the cluster at {config.master}")


@cluster.command()
def stop() -> None:
    """Stop this node's segment process: the cluster loses the objects it held."""
    run_dir = Path(load_settings().pool.dir)
    if segment.stop(run_dir):
        click.echo("segment process stopped: the objects it held are gone from the cluster")
    else:
        click.echo("no segment process runs for this node")
