"""What `hpkv config` shows: every setting, its value in words, where it came from and what it
means, as a table or as JSON. Owns the rendering only; `config.py` resolves the settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .config import KEYS, Setting, Settings
from .units import exact_bytes, short_duration

_KIND = {spec.name: spec.kind for spec in KEYS}
_DOC = {spec.name: spec.doc for spec in KEYS}


_NONE_WORDS = {
    "HPKV_KV_STORAGE_WRITE_BUDGET": "unlimited",
    "HPKV_KV_STORAGE_RETENTION": "off",
}  # what None means for a key; "auto" elsewhere


def _show(setting: Setting) -> str:
    value = setting.value
    if value is None:
        return _NONE_WORDS.get(setting.key, "auto")
    if isinstance(value, bool):
        return "true" if value else "false"
    if _KIND[setting.key] == "size":
        assert isinstance(value, int)  # what a "size" key parses to
        return f"{exact_bytes(value)} ({value} bytes)"
    if _KIND[setting.key] == "duration":
        assert isinstance(value, float)
        return f"{short_duration(value)} ({value:g} s)"
    return str(value)


def _json_value(setting: Setting) -> object:
    value = setting.value
    if value is None:
        return _NONE_WORDS.get(setting.key, "auto")
    return str(value) if isinstance(value, Path) else value


def _source_text(setting: Setting) -> str:
    return f"file {setting.where}" if setting.where not in ("env", "default") else setting.where


def print_table(settings: Settings) -> None:
    # Off a terminal (pipes, tests) rich would assume 80 columns and cut paths; never cut them.
    console = Console(width=None if sys.stdout.isatty() else 1000, highlight=False)
    table = Table(title=Text(f"HPKV settings (config file: {settings.config_file})"))
    table.add_column("key", no_wrap=True)
    table.add_column("value", no_wrap=True)
    table.add_column("source", no_wrap=True)
    table.add_column("meaning")
    for setting in settings.settings:
        table.add_row(*(Text(cell) for cell in (setting.key, _show(setting), _source_text(setting), _DOC[setting.key])))
    console.print(table)
    for warning in settings.warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)


def as_json(settings: Settings) -> str:
    document = {
        "settings": {
            s.key: {"value": _json_value(s), "source": s.source.value, "where": s.where} for s in settings.settings
        },
        "warnings": list(settings.warnings),
    }
    return json.dumps(document, indent=2)
