"""The NGC route of ``make install``: detect NVIDIA's PyTorch container, plan what to install in it.

The container ships its own torch build (with Apex and Transformer Engine compiled against it)
and pins it, with the other packages it was tested with, in a pip constraint file named by
``PIP_CONSTRAINT`` (``/etc/pip/constraint.txt`` in the NGC PyTorch images). Installing this
project's ``requirements.txt`` as is would either replace that torch with a PyPI wheel or stop
on a conflict with the constraint file. Inside the container ``make install`` therefore builds
``.venv`` with ``--system-site-packages`` over the container's Python and installs only the pins
the container lacks: every pin of ``requirements.txt`` except torch and except any package the
constraint file already pins, and the script says which.

    python tools/ngc_requirements.py route [--venv .venv]     # "ngc" or "pypi" (the reason on stderr)
    .venv/bin/python tools/ngc_requirements.py plan requirements.txt --out-dir .venv
    python tools/ngc_requirements.py requirements.txt > /tmp/requirements-ngc.txt   # the filter alone

Runs on the container's Python with the standard library only.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Mapping, Sequence

#: Never installed from PyPI inside the container: its own build is the point of the container.
ALWAYS_KEPT = {"torch"}

#: Installed builds of the container that no dependency may replace: pinned to their installed versions.
CONTAINER_BUILDS = ("torch", "transformer-engine", "apex")

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


def container_route(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether ``make install`` takes the NGC route (the container's packages), and why, in words.

    ``NGC=1`` / ``NGC=0`` force the route; otherwise the container is recognised by
    ``NVIDIA_PYTORCH_VERSION``, which every NGC PyTorch image sets (26.09: ``26.09``).
    ``PIP_CONSTRAINT`` alone (a file some sites set for every pip) does not select the route.

    Raises:
        ValueError: ``NGC`` is set to something other than 0 or 1.
    """
    force = environ.get("NGC", "").strip()
    if force == "1":
        return True, "NGC=1: the container's torch, Transformer Engine and Apex"
    if force == "0":
        return False, "NGC=0: PyPI's torch, no Transformer Engine or Apex"
    if force:
        raise ValueError(f"NGC={force!r}: use NGC=1 (the container's packages), NGC=0 (PyPI's) or leave it unset")
    version = environ.get("NVIDIA_PYTORCH_VERSION", "").strip()
    if version:
        where = environ.get("PIP_CONSTRAINT", "").strip() or "no pip constraint file"
        return True, f"NVIDIA_PYTORCH_VERSION={version} (NGC PyTorch container; {where})"
    return False, "not an NGC PyTorch container (NVIDIA_PYTORCH_VERSION unset)"


def venv_mismatch(venv: Path, ngc: bool) -> str | None:
    """A sentence saying why the existing ``venv`` does not fit the route, or None when it fits.

    The NGC route needs a venv made with ``--system-site-packages`` (``pyvenv.cfg``:
    ``include-system-site-packages = true``); the PyPI route needs one without.
    """
    cfg = Path(venv) / "pyvenv.cfg"
    if not cfg.is_file():
        return None
    system = re.search(r"^\s*include-system-site-packages\s*=\s*true\s*$", cfg.read_text(), re.M | re.I) is not None
    if ngc and not system:
        return (f"{venv} was made without the container's packages (PyPI's torch, no Transformer Engine or Apex). "
                f"Remove it and rerun: rm -rf {venv} && make install   (or keep it: NGC=0 on every make command)")
    if not ngc and system:
        return (f"{venv} was made over an NGC container's site-packages (--system-site-packages). "
                f"Outside the container remove it and rerun: rm -rf {venv} && make install   (or force: NGC=1)")
    return None


def installed_versions(paths: Sequence[str] | None = None) -> dict[str, str]:
    """``{canonical name: version}`` of the distributions on ``paths`` (default: this Python's ``sys.path``)."""
    dists = metadata.distributions(path=list(paths)) if paths is not None else metadata.distributions()
    out: dict[str, str] = {}
    for dist in dists:
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonical(name), dist.version)  # the first on the path wins, as for imports
    return out


@dataclass(frozen=True)
class InstallPlan:
    """What ``make install`` installs in the container.

    Attributes:
        requirements: the ``requirements.txt`` lines to install (``name==version``).
        notes: one line per pin left to the container, with the reason.
        constraints: the lines of the constraint file passed to pip (``-c``): the container's
            constraint file, plus its torch / Transformer Engine / Apex builds at their installed versions.
    """

    requirements: list[str]
    notes: list[str]
    constraints: list[str]


def install_plan(requirements: list[str], constraints: list[str], installed: Mapping[str, str]) -> InstallPlan:
    """Plan the NGC route's install: keep the container's torch and every pin of its constraint file.

    Args:
        requirements: lines of ``requirements.txt``.
        constraints: lines of the container's pip constraint file(s) (``PIP_CONSTRAINT``).
        installed: ``{canonical name: version}`` the container's Python sees (:func:`installed_versions`).

    Raises:
        RuntimeError: no torch is installed, so there is no container torch to keep.
    """
    if "torch" not in installed:
        raise RuntimeError("the NGC route keeps the container's torch, but this Python has none: run make install "
                           "inside nvcr.io/nvidia/pytorch, or take PyPI's torch with make install NGC=0")
    keep, notes = ngc_requirements(requirements, constraints)
    notes = [n.replace("the container's own torch stays", f"the container's own torch {installed['torch']} stays")
             for n in notes]
    pinned = pinned_names(constraints)
    builds = [f"{name}=={version}" for name, version in sorted(installed.items())
              if any(name == b or name.startswith(b + "-") for b in CONTAINER_BUILDS) and name not in pinned]
    return InstallPlan(keep, notes, list(pinned.values()) + builds)


def _route_main(argv: list[str]) -> int:
    """``route [--venv DIR]``: print ``ngc`` or ``pypi``; exit 1 when DIR does not fit the route."""
    try:
        ngc, why = container_route(os.environ)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if argv[:1] == ["--venv"] and len(argv) == 2:
        mismatch = venv_mismatch(Path(argv[1]), ngc)
        if mismatch:
            print(f"{mismatch}\n(route: {why})", file=sys.stderr)
            return 1
    elif argv:
        print(f"usage: ngc_requirements.py route [--venv DIR], not route {' '.join(argv)}", file=sys.stderr)
        return 2
    else:
        print(f"make install: the {'NGC' if ngc else 'PyPI'} route, {why}", file=sys.stderr)
    print("ngc" if ngc else "pypi")
    return 0


def _plan_main(argv: list[str]) -> int:
    """``plan requirements.txt --out-dir DIR``: write DIR/requirements-ngc.txt and DIR/constraints-ngc.txt."""
    if len(argv) != 3 or argv[1] != "--out-dir":
        print("usage: ngc_requirements.py plan requirements.txt --out-dir DIR", file=sys.stderr)
        return 2
    try:
        files = constraint_files(dict(os.environ))
        constraints = [line for f in files for line in f.read_text().splitlines()]
        plan = install_plan(Path(argv[0]).read_text().splitlines(), constraints, installed_versions())
    except (FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    out = Path(argv[2])
    (out / "requirements-ngc.txt").write_text("".join(f"{line}\n" for line in plan.requirements))
    (out / "constraints-ngc.txt").write_text("".join(f"{line}\n" for line in plan.constraints))
    print(f"pip constraint file(s): {', '.join(map(str, files)) or 'none (PIP_CONSTRAINT unset)'}", file=sys.stderr)
    for note in plan.notes:
        print(f"  {note}", file=sys.stderr)
    print(f"  installing {len(plan.requirements)} of the pins into {sys.prefix}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    """The command line (module docstring); returns the exit status (2: usage, 1: a missing file or no torch)."""
    if argv[1:2] == ["route"]:
        return _route_main(argv[2:])
    if argv[1:2] == ["plan"]:
        return _plan_main(argv[2:])
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
