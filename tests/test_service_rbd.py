"""RBD namespaces through TargetService: settings, identity kept with the image, restore, resize.

The tests marked ``ceph`` run against the real throwaway cluster (tests/ceph_cluster.py); the
others check what is refused before librados is ever asked.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from nvmeof import defaults
from target.service import ServiceError, TargetService
from tests.test_service import FakeTarget

MiB = 1 << 20
SUB = "nqn.2026-12.com.example:rbd"


async def _service(tmp_path: Path, conf: Path | None, *, config: Path | None = None) -> TargetService:
    svc = TargetService(FakeTarget(), config_path=config, backing_dirs=[tmp_path],
                        ceph_confs=[conf] if conf else [])
    return svc


async def _with_subsystem(svc: TargetService) -> TargetService:
    await svc.add_subsystem(SUB, allow_any_host=True)
    return svc


def _image_info(cluster: Any, image: str) -> dict[str, Any]:
    return json.loads(cluster.rbd("info", "--format", "json", f"{cluster.pool}/{image}"))


# --- refused before the cluster is asked --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"backend": "rbd", "options": {"pool": "rbd"}}, "needs image"),
        ({"backend": "rbd", "options": {"image": "x"}}, "needs pool"),
        ({"backend": "rbd", "options": {"pool": "rbd", "image": "x", "color": "red"}}, "no setting color"),
        ({"backend": "ram", "size": MiB, "options": {"pool": "rbd"}}, "takes none"),
        ({"backend": "rbd", "path": "/tmp/x", "options": {"pool": "rbd", "image": "x"}}, "takes no path"),
        ({"backend": "rbd", "create": True, "options": {"pool": "rbd", "image": "x"}}, "needs a size"),
        ({"backend": "rbd", "options": {"pool": "rbd", "image": "x", "ceph_conf": "/etc/passwd"}}, "--ceph-conf"),
        ({"backend": "rbd", "options": {"pool": "rbd", "image": "x", "ceph_keyring": "/etc/shadow"}},
         "--ceph-keyring"),
        ({"backend": "rbd", "options": {"pool": "rbd", "image": 7}}, "non-empty string"),
    ],
)
async def test_rbd_settings_refused_with_a_reason(tmp_path: Path, kwargs: dict[str, Any], fragment: str) -> None:
    svc = await _with_subsystem(await _service(tmp_path, None))
    with pytest.raises(ServiceError) as err:
        await svc.add_namespace(SUB, **kwargs)
    assert err.value.status == 400
    assert fragment in err.value.message
    assert svc.list_namespaces(SUB) == []


# --- against the real cluster -------------------------------------------------------------------


@pytest.mark.ceph
async def test_create_identity_and_second_gateway(ceph_cluster: Any, rbd_image: str, tmp_path: Path) -> None:
    options = {"pool": ceph_cluster.pool, "image": rbd_image}
    first = await _with_subsystem(await _service(tmp_path, ceph_cluster.conf))
    ns = await first.add_namespace(SUB, backend="rbd", size=32 * MiB, create=True, options=options)
    assert _image_info(ceph_cluster, rbd_image)["size"] == 32 * MiB
    stored = json.loads(ceph_cluster.rbd("image-meta", "get", f"{ceph_cluster.pool}/{rbd_image}",
                                         defaults.RBD_IDENTITY_KEY))
    assert stored == {"uuid": str(ns.uuid), "nguid": ns.nguid.hex(), "eui64": ns.eui64.hex()}
    entry = first.snapshot()["subsystems"][0]["namespaces"][0]
    assert (entry["backend"], entry["pool"], entry["image"]) == ("rbd", ceph_cluster.pool, rbd_image)

    # A second gateway (another service, no ids given) serves the same identity: the basis of multipath.
    second = await _with_subsystem(await _service(tmp_path, ceph_cluster.conf))
    ns2 = await second.add_namespace(SUB, backend="rbd", options=options)
    assert (ns2.uuid, ns2.nguid, ns2.eui64) == (ns.uuid, ns.nguid, ns.eui64)
    assert ns2.backend.size == 32 * MiB

    # Asking for a different identity than the image carries is refused, naming it.
    third = await _with_subsystem(await _service(tmp_path, ceph_cluster.conf))
    with pytest.raises(ServiceError) as err:
        await third.add_namespace(SUB, backend="rbd", options=options, nguid="11" * 16)
    assert "already carries nguid" in err.value.message
    for svc in (first, second):
        await svc.remove_namespace(SUB, 1)


@pytest.mark.ceph
async def test_same_image_twice_is_a_conflict(ceph_cluster: Any, rbd_image: str, tmp_path: Path) -> None:
    svc = await _with_subsystem(await _service(tmp_path, ceph_cluster.conf))
    options = {"pool": ceph_cluster.pool, "image": rbd_image}
    await svc.add_namespace(SUB, backend="rbd", size=8 * MiB, create=True, options=options)
    with pytest.raises(ServiceError) as err:
        # spelled with the conf given explicitly: still the same image
        await svc.add_namespace(SUB, backend="rbd", options={**options, "ceph_conf": str(ceph_cluster.conf)})
    assert err.value.status == 409 and "already backs namespace 1" in err.value.message
    await svc.remove_namespace(SUB, 1)


@pytest.mark.ceph
async def test_missing_image_refused_and_not_created(ceph_cluster: Any, rbd_image: str, tmp_path: Path) -> None:
    svc = await _with_subsystem(await _service(tmp_path, ceph_cluster.conf))
    with pytest.raises(ServiceError) as err:
        await svc.add_namespace(SUB, backend="rbd", options={"pool": ceph_cluster.pool, "image": rbd_image})
    assert err.value.status == 400 and rbd_image in err.value.message
    assert rbd_image not in ceph_cluster.rbd("ls", ceph_cluster.pool).split()


@pytest.mark.ceph
async def test_restore_keeps_identity_and_reports_a_missing_image(
    ceph_cluster: Any, rbd_image: str, tmp_path: Path
) -> None:
    config = tmp_path / "config.json"
    svc = await _with_subsystem(await _service(tmp_path, ceph_cluster.conf, config=config))
    ns = await svc.add_namespace(SUB, backend="rbd", size=8 * MiB, create=True,
                                 options={"pool": ceph_cluster.pool, "image": rbd_image})
    saved = json.loads(config.read_text())
    saved["subsystems"][0]["namespaces"].append(
        {"nsid": 2, "backend": "rbd", "pool": ceph_cluster.pool, "image": rbd_image + "-gone"})
    await svc.remove_namespace(SUB, 1)  # closes the image; the file below still names it

    again = await _service(tmp_path, ceph_cluster.conf, config=config)
    errors = await again.restore(saved)
    restored = again.get_namespace(SUB, 1)
    assert (restored.uuid, restored.nguid, restored.eui64) == (ns.uuid, ns.nguid, ns.eui64)
    assert len(errors) == 1 and rbd_image + "-gone" in errors[0]
    unrestored = again.unrestored()
    assert [u["item"]["image"] for u in unrestored] == [rbd_image + "-gone"]
    await again.remove_namespace(SUB, 1)


@pytest.mark.ceph
async def test_resize_grows_the_image_and_shrink_needs_allow_shrink(
    ceph_cluster: Any, rbd_image: str, tmp_path: Path
) -> None:
    svc = await _with_subsystem(await _service(tmp_path, ceph_cluster.conf))
    await svc.add_namespace(SUB, backend="rbd", size=8 * MiB, create=True,
                            options={"pool": ceph_cluster.pool, "image": rbd_image})
    await svc.resize_namespace(SUB, 1, 16 * MiB)
    assert _image_info(ceph_cluster, rbd_image)["size"] == 16 * MiB
    with pytest.raises(ServiceError):
        await svc.resize_namespace(SUB, 1, 4 * MiB)
    assert _image_info(ceph_cluster, rbd_image)["size"] == 16 * MiB
    await svc.resize_namespace(SUB, 1, 4 * MiB, allow_shrink=True)
    assert _image_info(ceph_cluster, rbd_image)["size"] == 4 * MiB
    await svc.remove_namespace(SUB, 1)


@pytest.mark.ceph
async def test_outside_resize_reaches_hosts_and_the_config(ceph_cluster: Any, rbd_image: str, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    target = FakeTarget()
    svc = TargetService(target, config_path=config, backing_dirs=[tmp_path], ceph_confs=[ceph_cluster.conf])
    await svc.add_subsystem(SUB, allow_any_host=True)
    ns = await svc.add_namespace(SUB, backend="rbd", size=8 * MiB, create=True,
                                 options={"pool": ceph_cluster.pool, "image": rbd_image})
    target.events.clear()
    await asyncio.to_thread(ceph_cluster.rbd, "resize", "--no-progress", "--size", "24M",
                            f"{ceph_cluster.pool}/{rbd_image}")
    for _ in range(200):
        if ns.backend.size == 24 * MiB and ("namespace_changed", SUB, 1) in target.events:
            break
        await asyncio.sleep(0.1)
    assert ns.backend.size == 24 * MiB
    assert ("namespace_changed", SUB, 1) in target.events
    for _ in range(50):
        if json.loads(config.read_text())["subsystems"][0]["namespaces"][0]["size"] == 24 * MiB:
            break
        await asyncio.sleep(0.1)
    assert json.loads(config.read_text())["subsystems"][0]["namespaces"][0]["size"] == 24 * MiB
    await svc.remove_namespace(SUB, 1)
