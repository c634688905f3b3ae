"""Write the requirements to install inside NVIDIA's NGC PyTorch container (``make install-ngc``).

The container ships its own torch build (with Apex and Transformer Engine compiled against it)
and pins it, with the other packages it was tested with, in a pip constraint file named by
``PIP_CONSTRAINT`` (``/etc/pip/constraint.txt`` in the NGC PyTorch images). Installing this
project's ``requirements.txt`` as is would either replace that torch with a PyPI wheel or stop
on a conflict with the constraint file. This script keeps every pin of ``requirements.txt``
except torch and except any package the constraint file already pins: for those the
container's version stays, and the script says which.

    python tools/ngc_requirements.py requirements.txt > /tmp/requirements-ngc.txt

Runs on the container's Python with the standard library only.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

#: Never installed from PyPI inside the container: its own build is the point of the container.
ALWAYS_KEPT = {"torch"}

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503 name: ``Megatron_Core`` -> ``megatron-core``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_names(lines: list[str]) -> dict[str, str]:
    """``{canonical name: the line}`` of every requirement or constraint line (comments skipped)."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        match = _NAME.match(line)
        if match and not line.startswith("-"):
            out[canonical(match.group(1))] = line
    return out


def constraint_files(environ: dict[str, str]) -> list[Path]:
    """The files ``PIP_CONSTRAINT`` names (space-separated, as pip reads it).

    Raises:
        FileNotFoundError: a named file does not exist (pip itself would stop on it).
    """
    files = [Path(p) for p in environ.get("PIP_CONSTRAINT", "").split()]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"PIP_CONSTRAINT names {missing}, which do not exist: fix or unset PIP_CONSTRAINT")
    return files


def ngc_requirements(requirements: list[str], constraints: list[str]) -> tuple[list[str], list[str]]:
    """Split ``requirements`` into (lines to install, notes on what the container keeps)."""
    pinned = pinned_names(constraints)
    keep, notes = [], []
    for name, line in pinned_names(requirements).items():
        if name in ALWAYS_KEPT:
            notes.append(f"{line}: skipped, the container's own {name} stays")
        elif name in pinned:
            notes.append(f"{line}: skipped, the container pins {pinned[name]}")
        else:
            keep.append(line)
    return keep, notes


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} requirements.txt > requirements-ngc.txt", file=sys.stderr)
        return 2
    try:
        files = constraint_files(dict(os.environ))
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    constraints = [line for f in files for line in f.read_text().splitlines()]
    keep, notes = ngc_requirements(Path(argv[1]).read_text().splitlines(), constraints)
    where = ", ".join(map(str, files)) or "none (PIP_CONSTRAINT unset)"
    print(f"pip constraint file(s): {where}", file=sys.stderr)
    for note in notes:
        print(f"  {note}", file=sys.stderr)
    print("\n".join(keep))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
