"""pfl-edge's own `export` package, even where a user's `export.py` shadows the name.

Our top-level package names are fixed, and `export` is a common file name in a user's project
(invoke's `tasks.py` and an `export.py` beside it). Whenever the working directory comes first
on `sys.path` (`python -m ...`, `python -c`, a script or pytest in that folder), `import export`
finds the user's file. Our code therefore reaches its export package through `own_module`, which
loads it under a private name when the plain name is taken, and leaves the user's module alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
"""The folder holding pfl-edge's top-level packages."""
PRIVATE_PREFIX: Final = "pfl_edge_own_"


def own_module(name: str) -> ModuleType:
    """Our module `name` (e.g. "export" or "export.mixture"), wherever the plain name leads.

    Raises:
        ImportError: our package is missing from its folder.
    """
    package, _, rest = name.partition(".")
    top = _own_package(package)
    return importlib.import_module(f"{top.__name__}.{rest}") if rest else top


def _own_package(package: str) -> ModuleType:
    folder = ROOT / package
    plain = sys.modules.get(package)
    if plain is None and _resolves_to(package, folder):
        plain = importlib.import_module(package)
    if plain is not None and _is_ours(plain, folder):
        return plain
    private = PRIVATE_PREFIX + package
    if private in sys.modules:
        return sys.modules[private]
    spec = importlib.util.spec_from_file_location(
        private, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        msg = f"pfl-edge's {package!r} package is missing from {folder}"
        raise ImportError(msg)
    module = importlib.util.module_from_spec(spec)
    sys.modules[private] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[private]
        raise
    return module


def _resolves_to(package: str, folder: Path) -> bool:
    """Whether a plain import of `package` would load the one in `folder` (without loading it)."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None and _inside(Path(spec.origin), folder)


def _is_ours(module: ModuleType, folder: Path) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and _inside(Path(origin), folder)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().parent == folder.resolve()
