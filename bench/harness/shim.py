"""Code that benchmarks and tests run inside an engine's own processes, at start.

An engine is started as users start it; what a benchmark or a test needs to change inside it (a
vLLM setting with no flag, a fault injected where the OS or the server would produce it) goes
into a `sitecustomize` module first on the engine's PYTHONPATH, which every Python process of the
engine runs at start. Primitives: `after_import(module, body)` -> source that runs `body` once
`module` is imported (the module bound to the name `module` there); `install(env, shim_dir,
code)` -> `env` with that sitecustomize.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

_AFTER_IMPORT = """\
import importlib.abc as _abc, importlib.util as _util, sys as _sys
class _After(_abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != {module!r}:
            return None
        _sys.meta_path.remove(self)
        spec = _util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
{body}
        spec.loader.exec_module = exec_module
        return spec
_sys.meta_path.insert(0, _After())
"""


def after_import(module: str, body: str) -> str:
    """Source of a sitecustomize fragment running `body` right after `module` is first imported.
    Fragments can be joined: each hooks its own module."""
    return _AFTER_IMPORT.format(module=module, body=textwrap.indent(textwrap.dedent(body).strip("\n"), " " * 12))


def install(env: dict[str, str], shim_dir: Path, code: str) -> dict[str, str]:
    """`env` with `code` as the sitecustomize first on the engine's PYTHONPATH."""
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "sitecustomize.py").write_text(code)
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(shim_dir), path]))}
