"""tools/pg_binaries.py, the PostgreSQL binaries of a major for bin/test --pg: the refusals (one
line, exit 2), the version check of what it finds, and a cache that is used as it is, offline."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pg_binaries", ROOT / "tools" / "pg_binaries.py")
assert spec is not None and spec.loader is not None
pg_binaries = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pg_binaries)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A temp dir the cluster's user can read too (pytest's own is root's alone when we are root)."""
    with tempfile.TemporaryDirectory(prefix="outboxpg-pgbin-test-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


def fake_bindir(tmp_path: Path, version: str) -> Path:
    """postgres, initdb and pg_ctl that answer --version as PostgreSQL ``version`` would."""
    bindir = tmp_path / version / "bin"
    bindir.mkdir(parents=True)
    for name in pg_binaries.CHECKED:
        exe = bindir / name
        exe.write_text(f"#!/bin/sh\necho '{name} (PostgreSQL) {version}'\n")
        exe.chmod(0o755)
    return bindir


def test_an_unknown_major_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert pg_binaries.main(["13"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "outboxpg: unknown PostgreSQL major 13 (one of 14, 15, 16, 17, 18)\n"
    assert pg_binaries.main(["latest"]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_bin_test_refuses_an_unknown_major_before_pytest() -> None:
    result = subprocess.run([str(ROOT / "bin" / "test"), "--pg", "9", "tests/unit"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == ["outboxpg: unknown PostgreSQL major 9 (one of 14, 15, 16, 17, 18)"]


def test_the_version_check_wants_the_major_asked_for(tmp_path: Path) -> None:
    bindir = fake_bindir(tmp_path, "16.15")
    assert pg_binaries.check(bindir, 16) == "postgres (PostgreSQL) 16.15"
    with pytest.raises(pg_binaries.PgBinariesError, match=r"did not answer PostgreSQL 17"):
        pg_binaries.check(bindir, 17)
    (bindir / "pg_ctl").unlink()
    with pytest.raises(pg_binaries.PgBinariesError, match=r"pg_ctl is missing"):
        pg_binaries.check(bindir, 16)


def test_a_cached_version_is_used_without_fetching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    major = 17
    version = pg_binaries.PINNED[major][0]
    fake_bindir(tmp_path, version.rsplit(".", 1)[0])
    (tmp_path / version.rsplit(".", 1)[0]).rename(tmp_path / version)
    monkeypatch.setenv("OUTBOXPG_PG_CACHE", str(tmp_path))
    monkeypatch.setattr(pg_binaries, "system_bindir", lambda major: None)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetched although cached")
    monkeypatch.setattr(pg_binaries, "_fetch", no_network)
    assert pg_binaries.main([str(major)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / version / 'bin'}\n"
    assert err == f"outboxpg: postgres (PostgreSQL) {version.rsplit('.', 1)[0]} (cached, {tmp_path / version / 'bin'})\n"
    if os.geteuid() == 0:   # readable and searchable by the cluster's user down to the binaries
        assert (tmp_path / version).stat().st_mode & 0o055 == 0o055


def test_the_pins_are_one_wheel_per_major() -> None:
    assert sorted(pg_binaries.PINNED) == [14, 15, 16, 17, 18]
    for major, (version, sha256) in pg_binaries.PINNED.items():
        assert version.startswith(f"{major}.") and len(sha256) == 64 and int(sha256, 16) >= 0
