"""A wheelhouse: every pinned package as files, so a room of laptops installs without a network.

    python tools/wheelhouse.py download [--dest wheelhouse] [--platform TAG ...]   # make wheelhouse
    python tools/wheelhouse.py install --python .venv/bin/python [--wheelhouse wheelhouse]   # make install

``download`` runs ``pip download`` of ``requirements.txt`` (with every dependency pip resolves)
and of the build backend ``pyproject.toml`` names (setuptools, for ``pip install -e .``) into one
folder: for this machine (its Python), and for each ``--platform`` (pip's platform tags, e.g.
``manylinux_2_28_aarch64``: torch's and megatron-core's Linux wheels are ``manylinux_2_28``;
binary wheels only, for ``--python-version``; macOS cannot be served, megatron-core publishes
no macOS wheel).
It prints the folder's size and the time taken. ``install`` is what ``make install`` runs when
the folder exists (or ``OFFLINE=1``): ``pip install --no-index --find-links FOLDER``, so pip
never reaches an index. Standard library only (it runs before anything is installed).

Sources: pip's documentation, "pip download" (``--platform``, ``--only-binary``,
``--python-version``) and "Installing from local packages" (``--no-index --find-links``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: pip's build backend for ``pip install -e .`` (pyproject.toml [build-system] requires).
BUILD_REQUIREMENTS = ("setuptools>=68",)


def folder_size(folder: Path) -> int:
    """Bytes of the files in ``folder`` (recursively)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def compatible_platforms(tag: str) -> list[str]:
    """The platform tags pip must be given for ``tag``: a ``manylinux_2_N_ARCH`` (PEP 600) machine also runs
    the wheels of every older glibc (``manylinux_2_M``, M < N, and their aliases ``manylinux2014`` = 2.17,
    ``manylinux2010`` = 2.12, ``manylinux1`` = 2.5), but ``pip download --platform`` (pip 23.2:
    ``_internal/utils/compatibility_tags.py`` expands only the legacy aliases) takes a tag literally: with
    ``manylinux_2_28_aarch64`` alone it finds no tokenizers 0.23.3 (a ``manylinux_2_17`` wheel). Other tags
    are returned as they are."""
    parts = tag.split("_", 3)
    if len(parts) != 4 or parts[0] != "manylinux" or not parts[1].isdigit() or not parts[2].isdigit():
        return [tag]
    major, minor, arch = int(parts[1]), int(parts[2]), parts[3]
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    tags += [f"{alias}_{arch}" for alias, since in (("manylinux2014", 17), ("manylinux2010", 12), ("manylinux1", 5))
             if major == 2 and minor >= since]
    return tags


def download(dest: Path, requirements: Path, platforms: list[str], python_version: str, pip: list[str]) -> dict:
    """``pip download`` the requirements and the build backend into ``dest``; returns size and seconds.

    Raises:
        RuntimeError: pip failed for one platform (named; pip's message is on stderr: a pin without
            a wheel for that ``--platform``, no network...).
    """
    dest.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    targets = [[]] + [["--only-binary=:all:", *[a for t in compatible_platforms(p) for a in ("--platform", t)],
                       "--python-version", python_version, "--implementation", "cp"] for p in platforms]
    for extra, platform in zip(targets, ["this machine", *platforms]):
        try:
            subprocess.run([*pip, "download", "--disable-pip-version-check", "-q", "-d", str(dest), *extra,
                            "-r", str(requirements), *BUILD_REQUIREMENTS], check=True)
        except subprocess.CalledProcessError as err:
            raise RuntimeError(f"pip download for {platform} failed (pip's message is above): a pin without a wheel "
                               "for that platform and Python, or no network") from err
    return {"files": len(list(dest.glob("*"))), "bytes": folder_size(dest), "seconds": time.perf_counter() - start}


def install_command(python: str, wheelhouse: Path, requirements: Path) -> list[list[str]]:
    """The two pip commands ``make install`` runs from a wheelhouse: the pins, then the project (``-e .``)."""
    offline = ["--disable-pip-version-check", "-q", "--no-index", "--find-links", str(wheelhouse)]
    return [[python, "-m", "pip", "install", *offline, "-r", str(requirements)],
            [python, "-m", "pip", "install", *offline, "--no-deps", "-e", str(requirements.parent)]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="fill the wheelhouse")
    d.add_argument("--dest", default=str(ROOT / "wheelhouse"))
    d.add_argument("--requirements", default=str(ROOT / "requirements.txt"))
    d.add_argument("--platform", action="append", default=[], help="another platform's pip tag (repeatable)")
    d.add_argument("--python-version", default="3.12", help="Python of the other platforms (default 3.12)")
    i = sub.add_parser("install", help="install the pins and the project from the wheelhouse, offline")
    i.add_argument("--python", required=True, help="the interpreter of the venv to install into")
    i.add_argument("--wheelhouse", default=str(ROOT / "wheelhouse"))
    i.add_argument("--requirements", default=str(ROOT / "requirements.txt"))
    args = parser.parse_args(argv)
    if args.command == "download":
        try:
            r = download(Path(args.dest), Path(args.requirements), args.platform, args.python_version,
                         [sys.executable, "-m", "pip"])
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"wheelhouse {args.dest}: {r['files']} files, {r['bytes'] / 1e9:.2f} GB, {r['seconds']:.0f} s")
        return 0
    wheelhouse = Path(args.wheelhouse)
    if not any(wheelhouse.glob("*.whl")):
        print(f"error: {wheelhouse} holds no wheels: run make wheelhouse (with a network) first, or copy one here",
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    for cmd in install_command(args.python, wheelhouse, Path(args.requirements)):
        if subprocess.run(cmd).returncode:
            print(f"error: {' '.join(cmd)} failed (pip's message is above): most often the wheelhouse lacks a "
                  f"package for this platform or this Python {sys.version_info[0]}.{sys.version_info[1]} (make "
                  "wheelhouse PLATFORMS=... WHEELHOUSE_PYTHON=... on a machine with a network), else a damaged "
                  "copy or a full disk", file=sys.stderr)
            return 1
    print(f"installed from {wheelhouse} without an index in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
