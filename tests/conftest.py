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
    Yields ``(ray, address)``. Started by the first test that asks for it and shut down after the last of them
    (``pytest_runtest_teardown``); those tests run last, one after another (``pytest_collection_modifyitems``),
    so one cluster serves them all (start-up takes seconds) and its processes do not load the other tests."""
    ray = pytest.importorskip("ray")
    if not _RAY:
        from ray.cluster_utils import Cluster

        store = 100 * 2**20
        lost = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}  # a lost node: dead in ~2 s
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "object_store_memory": store,
                "include_dashboard": False,
                "_system_config": lost,
            },
        )
        cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address, log_to_driver=False)
        _RAY.update(ray=ray, cluster=cluster, address=cluster.address)
    return _RAY["ray"], _RAY["address"]


@pytest.fixture
def ray_nodes(ray_cluster) -> object:
    """The test cluster's ``ray.cluster_utils.Cluster``, to add and remove nodes: a test leaves the two nodes it
    found (it removes only nodes it added)."""
    return _RAY["cluster"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))  # stable: last, in order


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _RAY and (nextitem is None or "ray_cluster" not in getattr(nextitem, "fixturenames", ())):
        _RAY["ray"].shutdown()
        _RAY["cluster"].shutdown()
        _RAY.clear()
