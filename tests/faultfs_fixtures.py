"""pytest fixtures for faultfs mounts (tests/faultfs.py); import them into a conftest.py or a
test module: ``from tests.faultfs_fixtures import faultfs_mounts  # noqa: F401``."""

from __future__ import annotations

import pytest

from tests.faultfs import FaultMount, missing_prerequisites
from tests.harness import require


def require_faultfs() -> None:
    require(missing_prerequisites(), "faultfs tests")


@pytest.fixture
def faultfs_mounts(tmp_path):
    """A factory: ``backing, mounts = faultfs_mounts(n, faults=None, per_mount=None)`` gives n
    faultfs mounts of one backing directory, each its own process with its own faults.

    ``faults`` is one rule set for every mount (a rule, a list of rules, or
    ``{"rules": [...]}``); ``per_mount`` is a list of n rule sets, one per mount (``None``
    for none). Can be called more than once (mounts are numbered on). Each mount is a :class:`tests.faultfs.FaultMount`: ``.path``
    is where to work, ``.set_faults(...)`` changes its faults at run time, ``.stats()``
    counts what was injected. Every mount is unmounted and its process stopped at
    teardown, also when the test fails; anything still mounted then fails the test.
    """
    require_faultfs()
    backing = tmp_path / "backing"
    base = tmp_path / "faultfs"
    base.mkdir()
    backing.mkdir()
    mounts: list[FaultMount] = []

    def make(n: int, faults=None, per_mount: list | None = None):
        if per_mount is not None and len(per_mount) != n:
            raise ValueError(f"per_mount has {len(per_mount)} rule sets for {n} mounts")
        new = []
        for i in range(n):
            m = FaultMount(backing, base / f"m{len(mounts)}", per_mount[i] if per_mount is not None else faults, workdir=base)
            mounts.append(m)
            m.start()
            new.append(m)
        return backing, new

    try:
        yield make
    finally:
        problems = []
        for m in reversed(mounts):
            try:
                m.close()
            except Exception as e:  # noqa: BLE001 - close every mount, then report
                problems.append(str(e))
        if problems:
            pytest.fail("faultfs teardown: " + "; ".join(problems), pytrace=False)

