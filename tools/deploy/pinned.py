"""Print the pinned requirement of one dependency from pyproject.toml (`torch==2.13.0`).

The image build installs torch and grpcio-tools before the project, at the project's pins:
    python tools/deploy/pinned.py torch
Exits 1 when the dependency is missing or not pinned with ==.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def pinned(name: str, pyproject: Path = PYPROJECT) -> str:
    """The `name==VERSION` requirement of the project, from its dependencies or any extra
    (torch is in the reference and minicpmo extras); ValueError when there is none, or when
    two places pin it differently."""
    with pyproject.open("rb") as file:
        project = tomllib.load(file)["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    found = set()
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.\-\[\],]+)\s*==\s*([0-9][0-9A-Za-z.+]*)", requirement)
        if match and match.group(1).split("[")[0].lower() == name.lower():
            found.add(f"{match.group(1)}=={match.group(2)}")
    if len(found) > 1:
        raise ValueError(f"{name} is pinned differently in {pyproject}: {sorted(found)}")
    if not found:
        raise ValueError(f"{name} is not pinned with == in {pyproject}")
    return found.pop()


def main(argv: list[str] | None = None) -> int:
    """Print each named dependency's pin; exit 1 naming the first that has none."""
    names = sys.argv[1:] if argv is None else argv
    try:
        for name in names:
            print(pinned(name))
    except ValueError as exc:
        print(f"pinned.py: {exc}", file=sys.stderr)
        return 1
    return 0 if names else 2


if __name__ == "__main__":
    sys.exit(main())
