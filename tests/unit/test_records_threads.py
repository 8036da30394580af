"""Records converted by several threads of one process at once (a rank's main, heartbeat and
monitor threads): msgspec builds a type's conversion info on first use and crashed (SIGSEGV)
when another thread converted the same type meanwhile. Fresh types in fresh processes, so
each try meets the first use."""

import subprocess
import sys

import pytest

PROGRAM = r"""
import sys, threading
from dataclasses import dataclass, field
from orchestrator.protocol import records
sys.setswitchinterval(1e-6)

@dataclass(frozen=True)
class Inner:
    name: str
    values: tuple[int, ...] = ()

@dataclass(frozen=True)
class Outer:
    rank: int
    inner: Inner
    by_rank: dict[int, Inner] = field(default_factory=dict)

body = records.to_dict(Outer(1, Inner("a", (1, 2)), {2: Inner("b")}))
start = threading.Barrier(8)

def convert():
    start.wait()
    for _ in range(50):
        assert records.from_dict(body, Outer, str_keys=True).inner.name == "a"

threads = [threading.Thread(target=convert) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
"""


@pytest.mark.timeout(120)
def test_threads_converting_a_record_type_for_the_first_time_at_once_do_not_crash_the_process():
    codes = [subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60).returncode for _ in range(12)]
    assert codes == [0] * 12, codes
