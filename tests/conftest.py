"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.ceph_cluster import CephCluster


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test (and every daemon it starts) gets its own state directory: nothing the suite runs
    may read or write the machine's real /var/lib/nvmeof or ~/.local/share/nvmeof (tokens, files)."""
    monkeypatch.setenv("NVMEOF_STATE_DIR", str(tmp_path_factory.mktemp("state")))


# Ceph (marker `ceph`): one throwaway one-node cluster for the whole session, started only when a
# test asks for it; the Debian packages are installed first when we are root and they are missing.

@pytest.fixture(scope="session")
def ceph_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephCluster]:
    from tests.ceph_cluster import CephCluster, install_if_missing

    reason = install_if_missing()
    if reason:
        pytest.skip(f"no Ceph cluster: {reason}")
    cluster = CephCluster(tmp_path_factory.mktemp("ceph"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def rbd_image(ceph_cluster: CephCluster) -> Iterator[str]:
    """A fresh image name in the cluster's pool (not created); the image is removed afterwards if a test made it."""
    import uuid

    from tests.ceph_cluster import CephClusterError

    name = f"t-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        ceph_cluster.rbd("rm", "--no-progress", f"{ceph_cluster.pool}/{name}")
    except CephClusterError as exc:
        if "No such file" not in str(exc) and "(2)" not in str(exc):
            raise


@pytest.fixture
def config_path(tmp_path):  # type: ignore[no-untyped-def]
    """Where a test's TargetService saves its configuration."""
    return tmp_path / "config.json"


@pytest.fixture
def service(config_path):  # type: ignore[no-untyped-def]
    """A TargetService over a fresh Target, saving to ``config_path``, file namespaces beside it."""
    from target.core import Target
    from target.service import TargetService

    return TargetService(Target(), config_path=config_path, backing_dirs=[config_path.parent])


@pytest.fixture
def client(service):  # type: ignore[no-untyped-def]
    """A started TestClient of the REST app over ``service`` (tests/api_client.py TOKEN); the target closes after."""
    from tests.api_client import open_client

    client = open_client(service)
    yield client
    client.portal.call(service.target.close)
    client.__exit__(None, None, None)


@pytest.fixture
def driver_runs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The BatchDriver of each bench job that took the batch path (None for one that did not)."""
    from initiator.bench.batch import BatchDriver

    seen: list[object] = []
    original = BatchDriver.for_runner.__func__   # type: ignore[attr-defined]

    def spy(cls: type[BatchDriver], runner: object) -> BatchDriver | None:
        driver = original(cls, runner)
        seen.append(driver)
        return driver

    monkeypatch.setattr(BatchDriver, "for_runner", classmethod(spy))
    return seen
