"""Checks of the CPU container (docker/cpu.Dockerfile) that need no container engine.

    python tools/container_check.py            # make container-check: both platforms, a network needed
    python tools/container_check.py --arch aarch64

What it does: reads the Dockerfile (:func:`instructions`), and resolves the project's pins for the image's
Linux on each platform with pip's ``--dry-run`` (:func:`resolve`: the wheels pip would install, nothing
installed): every pinned package, and every dependency, must come as a binary wheel for
``linux/amd64`` (``x86_64``) and ``linux/arm64`` (``aarch64``, Apple Silicon's containers).
``tests/test_container.py`` uses the same functions, and runs ``tools/container-install.sh`` itself.

The image's Linux is Debian 12 (``python:3.12-slim-bookworm``), glibc 2.36: it runs every wheel tagged
``manylinux_2_M`` with M <= 36 (PEP 600), which ``wheelhouse.compatible_platforms`` lists for pip.
Standard library only.

Sources: the Dockerfile reference (instructions, line continuations, ``RUN --mount``); pip's
documentation, "pip install" (``--dry-run``, ``--report``, ``--platform``, ``--only-binary``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "cpu.Dockerfile"
#: The image's glibc (Debian 12 bookworm): the newest manylinux tag its Python runs.
GLIBC = "2_36"
#: Docker's platform -> the machine name in pip's tags.
ARCHES = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheelhouse import compatible_platforms  # noqa: E402  (tools/ is not a package)


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """The Dockerfile's instructions as ``(KEYWORD, arguments)``, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        pending += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            out.append((keyword.upper(), " ".join(args.split())))
            pending = ""
    return out


def copy_sources(instrs: list[tuple[str, str]], before: int | None = None) -> list[str]:
    """The build-context paths the ``COPY`` instructions read (those among the first ``before`` instructions)."""
    sources = []
    for keyword, args in instrs[:before]:
        if keyword == "COPY":
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            sources += words[:-1]
    return sources


def bind_sources(instrs: list[tuple[str, str]]) -> list[str]:
    """The build-context folders ``RUN --mount=type=bind,source=...`` binds."""
    found = []
    for keyword, args in instrs:
        for word in shlex.split(args) if keyword == "RUN" else []:
            if word.startswith("--mount=") and "type=bind" in word:
                opts = dict(o.split("=", 1) for o in word[len("--mount="):].split(",") if "=" in o)
                found.append(opts.get("source", opts.get("src", ".")))
    return found


def env(instrs: list[tuple[str, str]]) -> dict[str, str]:
    """The ``ENV`` values (``KEY=VALUE`` form), ``$PATH``-style references left as written."""
    values: dict[str, str] = {}
    for keyword, args in instrs:
        if keyword == "ENV":
            for word in shlex.split(args):
                key, _, value = word.partition("=")
                values[key] = value
    return values


def cmd(instrs: list[tuple[str, str]]) -> list[str]:
    """The last ``CMD`` (JSON form) as a list."""
    return json.loads([args for keyword, args in instrs if keyword == "CMD"][-1])


def normalize(name: str) -> str:
    """A package name as PEP 503 compares them: lower case, runs of ``-_.`` as one ``-``."""
    import re

    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def pip_platform_args(arch: str, glibc: str = GLIBC) -> list[str]:
    """``--platform`` arguments for the image's Linux on ``arch`` (every manylinux tag its glibc runs)."""
    return [a for t in compatible_platforms(f"manylinux_{glibc}_{arch}") for a in ("--platform", t)]


def resolve(arch: str, requirements: Path = ROOT / "requirements.txt", python_version: str = "3.12",
            python: str = sys.executable, no_deps: bool = False) -> dict:
    """What ``pip install -r requirements`` would install in the image on ``arch``, resolved, not installed.

    Runs ``pip install --dry-run --ignore-installed --only-binary=:all:`` with the image's platform tags
    (:func:`pip_platform_args`) and ``--report``; needs the package index. ``no_deps``: the pins only
    (seconds; with their dependencies it takes minutes on 2 cores: 181 s and 232 s measured here).

    Returns:
        ``{"arch", "seconds", "wheels": {name: file name}, "compiled": [names of non-pure wheels]}``.

    Raises:
        RuntimeError: pip found no binary wheel for a package on ``arch`` (pip's message included), or no index.
    """
    with tempfile.TemporaryDirectory(prefix="container-check-") as tmp:
        report = Path(tmp) / "report.json"
        start = time.perf_counter()
        proc = subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--dry-run",
                               "--ignore-installed", "--only-binary=:all:", *pip_platform_args(arch),
                               "--python-version", python_version, "--implementation", "cp", "--target", str(Path(tmp) / "t"),
                               "--report", str(report), *(["--no-deps"] if no_deps else []), "-r", str(requirements)], capture_output=True, text=True)
        if proc.returncode:
            errors = "\n".join(line for line in proc.stderr.splitlines() if "ERROR" in line) or proc.stderr[-2000:]
            raise RuntimeError(f"linux/{arch}: pip found no complete set of binary wheels for {requirements.name}:\n{errors}")
        data = json.loads(report.read_text())
    wheels = {normalize(i["metadata"]["name"]): i["download_info"]["url"].rsplit("/", 1)[-1] for i in data["install"]}
    compiled = sorted(n for n, f in wheels.items() if not f.endswith("-any.whl"))
    return {"arch": arch, "seconds": time.perf_counter() - start, "wheels": wheels, "compiled": compiled}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", action="append", choices=sorted(ARCHES.values()), help="default: both")
    args = parser.parse_args(argv)
    instrs = instructions()
    missing = [s for s in copy_sources(instrs) + bind_sources(instrs) if not (ROOT / s).exists()]
    print(f"{DOCKERFILE.relative_to(ROOT)}: {len(instrs)} instructions; COPY/bind sources "
          + ("all present" if not missing else f"MISSING {missing}"))
    failed = bool(missing)
    pins = [normalize(line.split("==")[0]) for line in (ROOT / "requirements.txt").read_text().splitlines()
            if "==" in line and not line.lstrip().startswith("#")]
    for arch in args.arch or ARCHES.values():
        try:
            r = resolve(arch)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            failed = True
            continue
        compiled_pins = [p for p in pins if p in r["compiled"]]
        print(f"linux/{arch}: {len(r['wheels'])} wheels resolved in {r['seconds']:.0f} s, all binary; "
              f"pins with compiled code: " + ", ".join(f"{r['wheels'][p]}" for p in compiled_pins))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
