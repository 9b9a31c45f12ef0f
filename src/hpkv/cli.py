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

from hpkv import __version__
from hpkv.config import KEYS, Setting, Settings, load_settings
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

_KIND = {spec.name: spec.kind for spec in KEYS}
_DOC = {spec.name: spec.doc for spec in KEYS}


def _human_bytes(size_bytes: int) -> str:
    for unit, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if size_bytes >= 1024 ** power:
            return f"{size_bytes / 1024 ** power:g} {unit}"
    return f"{size_bytes} B"


def _show(setting: Setting) -> str:
    value = setting.value
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    if _KIND[setting.key] == "size":
        return f"{_human_bytes(value)} ({value} bytes)"
    return str(value)


def _json_value(value: object) -> object:
    if value is None:
        return "auto"
    return str(value) if isinstance(value, Path) else value


def _source_text(setting: Setting) -> str:
    return f"file {setting.where}" if setting.where not in ("env", "default") else setting.where


def _print_table(settings: Settings) -> None:
    # Off a terminal (pipes, tests) rich would assume 80 columns and cut paths; never cut them.
    console = Console(width=None if sys.stdout.isatty() else 1000, highlight=False)
    table = Table(title=Text(f"HPKV settings (config file: {settings.config_file})"))
    table.add_column("key", no_wrap=True)
    table.add_column("value", no_wrap=True)
    table.add_column("source", no_wrap=True)
    table.add_column("meaning")
    for setting in settings.settings:
        table.add_row(*(Text(cell) for cell in (setting.key, _show(setting), _source_text(setting),
                                                 _DOC[setting.key])))
    console.print(table)
    for warning in settings.warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)


def _print_json(settings: Settings) -> None:
    document = {
        "settings": {s.key: {"value": _json_value(s.value), "source": s.source.value,
                             "where": s.where} for s in settings.settings},
        "warnings": list(settings.warnings),
    }
    click.echo(json.dumps(document, indent=2))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def config(as_json: bool) -> None:
    """Show every setting, its value and where it came from (file, env, default)."""
    settings = load_settings()
    if as_json:
        _print_json(settings)
    else:
        _print_table(settings)
