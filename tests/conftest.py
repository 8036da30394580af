import pytest

from tests.harness import Cluster


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp=tmp_path, log_path=tmp_path / "run")
    yield c
    c.kill_all()
