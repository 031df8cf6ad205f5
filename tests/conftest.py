from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rolloutcli.cli import main

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_data" / "cartpole_gru.h5"


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run the CLI in-process: ``code, stdout, stderr = cli("inspect", path)``."""

    def run(*args: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's one Ray cluster: two nodes (two raylets, two object stores) of one CPU and 100 MB each.
    Yields ``(ray, address)``; tests that need Ray share it (start-up takes seconds)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    store = 100 * 2**20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": store, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, object_store_memory=store)
    ray.init(address=cluster.address, log_to_driver=False)
    yield ray, cluster.address
    ray.shutdown()
    cluster.shutdown()
