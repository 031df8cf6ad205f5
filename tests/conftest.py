from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rolloutcli.cli.app import main

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


_RAY: dict = {}  # the running test cluster: ray, cluster, address


@pytest.fixture
def ray_cluster():
    """The one Ray cluster of the tests: two nodes (two raylets, two object stores) of one CPU and 100 MB each.
    Yields ``(ray, address)``. Started by the first test that asks for it and shut down after the last of a run
    of such tests (``pytest_runtest_teardown``), so its processes do not load the timing-sensitive tests; keep
    the tests that use it together (start-up takes seconds)."""
    ray = pytest.importorskip("ray")
    if not _RAY:
        from ray.cluster_utils import Cluster

        store = 100 * 2**20
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": store, "include_dashboard": False},
        )
        cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address, log_to_driver=False)
        _RAY.update(ray=ray, cluster=cluster, address=cluster.address)
    return _RAY["ray"], _RAY["address"]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _RAY and (nextitem is None or "ray_cluster" not in getattr(nextitem, "fixturenames", ())):
        _RAY["ray"].shutdown()
        _RAY["cluster"].shutdown()
        _RAY.clear()
