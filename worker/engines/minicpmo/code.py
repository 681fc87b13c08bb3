"""Import the model code a checkpoint directory carries, as the demo servers do: a package
made of the directory, so relative imports resolve and nothing is copied to a module cache.

transformers' trust_remote_code path refuses a modeling file whose optional imports are not
installed (the demo's `import flag_gems` under an environment switch); a direct import runs
the file as its authors run it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def package_name(root: Path) -> str:
    """A stable package name for the code in `root` (one per directory)."""
    digest = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]
    return f"omni_minicpmo_code_{digest}"


def import_module(root: Path, name: str) -> ModuleType:
    """`root/name.py` imported as a submodule of the directory's package. Raises
    ImportError (a missing dependency of the model code, or no such file)."""
    package = package_name(root)
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, root / "__init__.py", submodule_search_locations=[str(root)]
        )
        if spec is None:
            raise ImportError(f"cannot make a package of {root}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module  # no __init__.py is executed: the folder is the package
    if not (root / f"{name}.py").is_file():
        raise ImportError(f"{root} has no {name}.py")
    return importlib.import_module(f"{package}.{name}")
