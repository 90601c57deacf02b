"""The RBD backend (target/backends/rbd.py) against a real one-node Ceph cluster (tests/ceph_cluster.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nvmeof import defaults
from nvmeof.status import Status
from target.backends import BACKENDS, StoragePolicy, backend_class, open_backend
from target.backends.base import BackendError, BackendSpec, BackendUnavailable
from target.backends.file import BackingError
from target.backends.rbd import CephPolicy
from tests.ceph_cluster import CephCluster, unusable_reason

pytestmark = pytest.mark.ceph
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def rbd_mod(ceph_cluster: CephCluster) -> types.ModuleType:
    from target.backends import rbd

    return rbd


def _policy(cluster: CephCluster, **kw: Any) -> CephPolicy:
    return CephPolicy(ceph_confs=[cluster.conf], **kw)


def _open(cluster: CephCluster, image: str, *, size: int | None = None, create: bool = False,
          read_only: bool = False, **options: Any) -> Any:
    opts = {"pool": cluster.pool, "image": image, **options}
    return backend_class("rbd").open(BackendSpec(size=size, create=create, read_only=read_only, options=opts),
                                     _policy(cluster))


@pytest.fixture
def opened(ceph_cluster: CephCluster) -> Iterator[Callable[..., Any]]:
    """``_open`` that closes (and waits for) every backend the test left open."""
    made: list[Any] = []

    def opener(*args: Any, **kw: Any) -> Any:
        backend = _open(ceph_cluster, *args, **kw)
        made.append(backend)
        return backend

    yield opener
    for backend in made:
        backend.close()
        assert backend.wait_closed(30)


def _image_size(cluster: CephCluster, image: str) -> int:
    return json.loads(cluster.rbd("info", "--format", "json", f"{cluster.pool}/{image}"))["size"]


def _exported(cluster: CephCluster, image: str) -> bytes:
    return cluster.rbd_bytes("export", "--no-progress", f"{cluster.pool}/{image}", "-")


def _images(cluster: CephCluster) -> list[str]:
    return json.loads(cluster.rbd("ls", "--format", "json", cluster.pool))


async def _until(predicate: Callable[[], bool], seconds: float = 20) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


# --- registration, loading ----------------------------------------------------------------------


def test_registered_lazily_and_loader_names_packages() -> None:
    assert BACKENDS["rbd"] in ("target.backends.rbd:RbdBackend", backend_class("rbd"))
    from target.backends.rbd import INSTALL_HINT, load_rbd

    assert "apt-get install python3-rbd python3-rados" in INSTALL_HINT
    if unusable_reason():
        pytest.skip(unusable_reason())
    rados, rbd = load_rbd()
    assert hasattr(rbd.Image, "aio_write") and hasattr(rados, "Rados")


def test_loader_skips_a_plain_module_named_rbd(tmp_path: Path) -> None:
    """A script folder with an rbd.py on sys.path (benchmarks/ is put there by a test) must not
    stand in for librbd's binding."""
    if unusable_reason():
        pytest.skip(unusable_reason())
    (tmp_path / "rbd.py").write_text("raise SystemExit('the plain rbd.py was imported')\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from target.backends.rbd import load_rbd; "
            "rados, rbd = load_rbd(); print(rbd.__file__, hasattr(rbd, 'Image'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.strip().endswith(".so True"), out


def test_unavailable_maps_to_retryable_status() -> None:
    from target.io import _backend_failed

    ns = types.SimpleNamespace(nsid=1, backend=types.SimpleNamespace(kind="rbd"))
    err = _backend_failed(ns, "write", BackendUnavailable("cluster gone"))   # type: ignore[arg-type]
    assert err.status == Status.NS_NOT_READY and not err.dnr   # the Linux host retries it
    other = _backend_failed(ns, "write", BackendError("bad"))   # type: ignore[arg-type]
    assert other.status == Status.INTERNAL and other.dnr


# --- opening: the no-surprise size rules --------------------------------------------------------


def test_missing_image_needs_create_and_size(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    with pytest.raises(BackendError, match=r"does not exist; create it first.*create, --create"):
        opened(rbd_image)
    with pytest.raises(BackendError, match="no size was given"):
        opened(rbd_image, create=True)
    with pytest.raises(BackendError, match="read-only"):
        opened(rbd_image, size=4 * MiB, create=True, read_only=True)
    assert rbd_image not in _images(ceph_cluster)


def test_create_then_close_unused_removes_image(ceph_cluster: CephCluster, rbd_image: str) -> None:
    backend = _open(ceph_cluster, rbd_image, size=4 * MiB, create=True)
    assert backend.created and backend.size == 4 * MiB
    assert _image_size(ceph_cluster, rbd_image) == 4 * MiB
    backend.close_unused()
    assert backend.wait_closed(30)
    assert rbd_image not in _images(ceph_cluster)


def test_larger_image_exports_prefix_untouched(ceph_cluster: CephCluster, rbd_image: str) -> None:
    ceph_cluster.rbd("create", "--size", "8M", f"{ceph_cluster.pool}/{rbd_image}")
    backend = _open(ceph_cluster, rbd_image, size=4 * MiB)
    assert backend.size == 4 * MiB and not backend.created
    backend.close_unused()   # it changed nothing, so nothing is taken back
    assert backend.wait_closed(30)
    assert _image_size(ceph_cluster, rbd_image) == 8 * MiB
    whole = _open(ceph_cluster, rbd_image)
    assert whole.size == 8 * MiB   # no size: the whole image
    whole.close()
    assert whole.wait_closed(30)


def test_smaller_image_grown_only_with_create(ceph_cluster: CephCluster, rbd_image: str) -> None:
    ceph_cluster.rbd("create", "--size", "4M", f"{ceph_cluster.pool}/{rbd_image}")
    with pytest.raises(BackendError, match=r"less than the size .* asked for.*create"):
        _open(ceph_cluster, rbd_image, size=8 * MiB)
    assert _image_size(ceph_cluster, rbd_image) == 4 * MiB
    backend = _open(ceph_cluster, rbd_image, size=8 * MiB, create=True)
    assert backend.size == 8 * MiB and backend.grown_from == 4 * MiB and not backend.created
    assert _image_size(ceph_cluster, rbd_image) == 8 * MiB
    backend.close_unused()   # shrinks it back to what it was
    assert backend.wait_closed(30)
    assert _image_size(ceph_cluster, rbd_image) == 4 * MiB
    assert rbd_image in _images(ceph_cluster)


# --- names and configuration refused --------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"pool": "a/b"}, r"pool 'a/b' may not contain '/' or '@'"),
    ({"image": "img@snap"}, r"image 'img@snap' may not contain"),
    ({"image": ""}, r"image must be a non-empty name"),
    ({"rbd_namespace": ""}, r"rbd_namespace must be a non-empty name.*leave it out"),
    ({"image": "x" * 300}, r"image is 300 bytes long; at most 255"),
    ({"ceph_id": "bad id"}, r"ceph_id must be a Ceph client name"),
])
def test_bad_settings_refused(ceph_cluster: CephCluster, options: dict[str, Any], message: str) -> None:
    opts = {"pool": ceph_cluster.pool, "image": "img", **options}
    with pytest.raises(BackendError, match=message):
        backend_class("rbd").open(BackendSpec(options=opts), _policy(ceph_cluster))


def test_a_setting_rbd_does_not_take_is_refused_by_the_registry(ceph_cluster: CephCluster) -> None:
    opts = {"pool": ceph_cluster.pool, "image": "img", "colour": "blue"}
    with pytest.raises(BackendError, match=r"rbd namespace has no setting colour; it takes pool, image"):
        open_backend("rbd", options=opts, policy=StoragePolicy({"rbd": _policy(ceph_cluster)}))


def test_missing_pool_image_namespace_and_conf(ceph_cluster: CephCluster, tmp_path: Any) -> None:
    cls = backend_class("rbd")
    with pytest.raises(BackendError, match=r"needs pool"):
        cls.open(BackendSpec(options={"image": "x"}), _policy(ceph_cluster))
    with pytest.raises(BackendError, match=r"pool nopool does not exist.*ceph osd pool create nopool"):
        _open(ceph_cluster, "x", pool="nopool")
    with pytest.raises(BackendError, match=r"RADOS namespace nons does not exist.*rbd namespace create"):
        _open(ceph_cluster, "x", rbd_namespace="nons")
    other = tmp_path / "other.conf"
    other.write_text(ceph_cluster.conf.read_text())
    with pytest.raises(BackingError, match=r"not one the daemon was started with.*--ceph-conf"):
        _open(ceph_cluster, "x", ceph_conf=str(other))
    gone = tmp_path / "gone.conf"
    with pytest.raises(BackendError, match=r"gone.conf does not exist"):
        cls.open(BackendSpec(options={"pool": "rbd", "image": "x"}), CephPolicy(ceph_confs=[gone]))


def test_namespace_image(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    ceph_cluster.rbd("namespace", "create", f"{ceph_cluster.pool}/tenant1")
    backend = opened(rbd_image, size=4 * MiB, create=True, rbd_namespace="tenant1")
    assert backend.describe()["rbd_namespace"] == "tenant1"
    listed = json.loads(ceph_cluster.rbd("ls", "--format", "json", f"{ceph_cluster.pool}/tenant1"))
    assert listed == [rbd_image] and rbd_image not in _images(ceph_cluster)
    backend.close_unused()
    assert backend.wait_closed(30)
    assert json.loads(ceph_cluster.rbd("ls", "--format", "json", f"{ceph_cluster.pool}/tenant1")) == []


# --- data ---------------------------------------------------------------------------------------


async def test_data_round_trip_seen_by_rbd_export(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    backend = opened(rbd_image, size=4 * MiB, create=True)
    pattern = os.urandom(64 * 1024)
    await backend.write(0, pattern)
    await backend.write(1 * MiB, memoryview(bytearray(b"F" * 4096)), fua=True)
    await backend.write(2 * MiB, memoryview(pattern)[4096:8192])   # a view of part of a buffer
    await backend.flush()
    assert await backend.read(0, len(pattern)) == pattern
    buf = memoryview(bytearray(4096))
    await backend.read_into(1 * MiB, buf)
    assert bytes(buf) == b"F" * 4096
    await backend.write_zeroes(4096, 4096)
    await backend.discard(16384, 4096)            # a partial-object discard must read back as zeros too
    expected = bytearray(4 * MiB)
    expected[:len(pattern)] = pattern
    expected[1 * MiB:1 * MiB + 4096] = b"F" * 4096
    expected[2 * MiB:2 * MiB + 4096] = pattern[4096:8192]
    expected[4096:8192] = bytes(4096)
    expected[16384:20480] = bytes(4096)
    assert await backend.read(0, 64 * 1024) == bytes(expected[:64 * 1024])
    assert _exported(ceph_cluster, rbd_image) == bytes(expected)   # another client sees every write
    assert backend.can_deallocate


async def test_ranges_and_read_only(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    backend = opened(rbd_image, size=4 * MiB, create=True)
    with pytest.raises(BackendError, match="past the end"):
        await backend.read(4 * MiB - 512, 1024)
    with pytest.raises(BackendError, match="past the end"):
        await backend.write(4 * MiB, b"x")
    await backend.write(0, b"r" * 512)
    ro = opened(rbd_image, read_only=True)
    assert ro.read_only and await ro.read(0, 512) == b"r" * 512
    with pytest.raises(BackendError, match="read-only"):
        await ro.write(0, b"x" * 512)
    with pytest.raises(BackendError, match=r"read-only.*grow"):
        await ro.resize(8 * MiB)
    with pytest.raises(BackendError, match=r"read-only.*rbd image-meta set"):
        ro.store_identity({"uuid": "u", "nguid": "n", "eui64": "e"})


class _Outstanding:
    """An Image stand-in counting the aio reads librbd has been given but not yet answered."""

    def __init__(self, image: Any) -> None:
        self.image, self.lock, self.now, self.most = image, threading.Lock(), 0, 0
        self.given = 0
        self.answers: list[int] = []    # librbd's return values, in the order it answered
        self.slowest = 0.0              # the longest an aio_read call held the caller (the event loop)

    def aio_read(self, offset: int, length: int, oncomplete: Callable[..., None]) -> Any:
        def answered(completion: Any, data: Any) -> None:
            with self.lock:
                self.now -= 1
                self.answers.append(completion.get_return_value())
            oncomplete(completion, data)

        with self.lock:
            self.now += 1
            self.given += 1
            self.most = max(self.most, self.now)
        began = time.monotonic()
        try:
            return self.image.aio_read(offset, length, answered)
        finally:
            self.slowest = max(self.slowest, time.monotonic() - began)

    def explain(self) -> str:
        """What librbd did with the reads: for a failure's message (CI once saw 0 of 32 in flight; answers of
        4096 mean the OSD served them, i.e. it was not stopped yet: suspend_osd now waits for that)."""
        return (f"{self.now} in librbd now, {self.given} given, at most {self.most} at once, answers "
                f"{sorted(set(self.answers))} x{len(self.answers)}, slowest aio_read call {self.slowest:.2f} s")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.image, name)


async def test_32_reads_in_flight_at_once(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    """Queue depth reaches librbd: with the OSD stopped, 32 reads are all given to librbd (none
    waits for another); once it runs again every one completes with the right data."""
    backend = opened(rbd_image, size=4 * MiB, create=True)
    data = os.urandom(32 * 4096)
    await backend.write(0, data)
    counting = _Outstanding(backend._image)
    backend._image = counting
    ceph_cluster.suspend_osd()
    try:
        reads = [asyncio.ensure_future(backend.read(i * 4096, 4096)) for i in range(32)]
        assert await _until(lambda: counting.now == 32), f"not 32 reads in librbd at once: {counting.explain()}"
        assert not any(r.done() for r in reads)
    finally:
        ceph_cluster.resume_osd()
    results = await asyncio.wait_for(asyncio.gather(*reads), 60)
    assert b"".join(results) == data
    assert counting.most == 32 and counting.now == 0


# --- resize -------------------------------------------------------------------------------------


async def test_resize_grow_shrink_and_revert(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    backend = opened(rbd_image, size=4 * MiB, create=True)
    old = await backend.resize(8 * MiB)
    assert old == 4 * MiB and backend.size == 8 * MiB and _image_size(ceph_cluster, rbd_image) == 8 * MiB
    await backend.write(8 * MiB - 4096, b"t" * 4096)   # the new tail is usable
    await backend.revert_resize(4 * MiB, old)
    assert backend.size == 4 * MiB and _image_size(ceph_cluster, rbd_image) == 4 * MiB
    with pytest.raises(BackendError, match="allow_shrink"):
        await backend.resize(2 * MiB)
    assert _image_size(ceph_cluster, rbd_image) == 4 * MiB
    old = await backend.resize(2 * MiB, allow_shrink=True)   # the namespace is the whole image: it shrinks
    assert old == 4 * MiB and backend.size == 2 * MiB and _image_size(ceph_cluster, rbd_image) == 2 * MiB
    await backend.revert_resize(4 * MiB, old)
    assert _image_size(ceph_cluster, rbd_image) == 4 * MiB


async def test_resize_of_prefix_leaves_image(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    ceph_cluster.rbd("create", "--size", "8M", f"{ceph_cluster.pool}/{rbd_image}")
    backend = opened(rbd_image, size=4 * MiB)
    assert await backend.resize(2 * MiB, allow_shrink=True) is None
    assert await backend.resize(6 * MiB) is None   # still inside the image: nothing to change
    assert backend.size == 6 * MiB and _image_size(ceph_cluster, rbd_image) == 8 * MiB


async def test_outside_resize_noticed(ceph_cluster: CephCluster, rbd_image: str, opened: Any,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "RBD_SIZE_POLL", 0.1)
    whole = opened(rbd_image, size=4 * MiB, create=True)
    prefix = opened(rbd_image, size=2 * MiB)
    seen_whole: list[int] = []
    seen_prefix: list[int] = []
    whole.watch_size(seen_whole.append)
    prefix.watch_size(seen_prefix.append)
    await asyncio.sleep(0.3)
    assert seen_whole == [] and seen_prefix == []   # nothing changed: no call
    ceph_cluster.rbd("resize", "--no-progress", "--size", "8M", f"{ceph_cluster.pool}/{rbd_image}")
    assert await _until(lambda: seen_whole == [8 * MiB]), seen_whole
    assert whole.size == 8 * MiB
    await asyncio.sleep(0.3)
    assert seen_prefix == [] and prefix.size == 2 * MiB   # a prefix keeps the size it was given
    ceph_cluster.rbd("resize", "--no-progress", "--allow-shrink", "--size", "1M", f"{ceph_cluster.pool}/{rbd_image}")
    assert await _until(lambda: seen_prefix == [1 * MiB]), seen_prefix   # ...unless the image ends before it
    assert await _until(lambda: seen_whole == [8 * MiB, 1 * MiB]), seen_whole
    assert prefix.size == 1 * MiB and whole.size == 1 * MiB
    await whole.resize(2 * MiB)   # our own resize is no outside change
    await asyncio.sleep(0.5)
    assert seen_whole == [8 * MiB, 1 * MiB]


# --- identity, description, workers, connections ------------------------------------------------


def test_identity_stored_with_image(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    first = opened(rbd_image, size=4 * MiB, create=True)
    assert first.stored_identity() is None
    ids = {"uuid": "5c1d2a8e-6c3e-4b57-9d36-0d8c2f1e7a10", "nguid": "00" * 16, "eui64": "11" * 8}
    first.store_identity(ids)
    first.close()
    assert first.wait_closed(30)
    second = opened(rbd_image)
    assert second.stored_identity() == ids
    raw = ceph_cluster.rbd("image-meta", "get", f"{ceph_cluster.pool}/{rbd_image}", defaults.RBD_IDENTITY_KEY)
    assert json.loads(raw) == ids
    ceph_cluster.rbd("image-meta", "set", f"{ceph_cluster.pool}/{rbd_image}", defaults.RBD_IDENTITY_KEY, "junk")
    with pytest.raises(BackendError, match=r"holds no namespace identity.*rbd image-meta remove"):
        second.stored_identity()


def test_describe_names_but_no_secrets(ceph_cluster: CephCluster, rbd_image: str, opened: Any,
                                       tmp_path: Any) -> None:
    keyring = tmp_path / "client.keyring"
    keyring.write_text("[client.admin]\n\tkey = AQBSECRETSECRETSECRETSECRETSECRETSEC==\n")
    opts = {"pool": ceph_cluster.pool, "image": rbd_image, "ceph_keyring": str(keyring)}
    policy = CephPolicy(ceph_confs=[ceph_cluster.conf], ceph_keyrings=[keyring])
    backend = backend_class("rbd").open(BackendSpec(size=4 * MiB, create=True, options=opts), policy)
    try:
        described = backend.describe()
        assert described["pool"] == ceph_cluster.pool and described["image"] == rbd_image
        assert described["ceph_keyring"] == str(keyring) and "SECRET" not in json.dumps(described)
    finally:
        backend.close()
        assert backend.wait_closed(30)


async def test_worker_attach_serves_same_image(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    backend = opened(rbd_image, size=4 * MiB, create=True)
    await backend.write(0, b"w" * 4096)
    description, fds = backend.describe_for_worker()
    assert fds == []
    json.dumps(description)   # it travels as JSON
    worker = backend_class("rbd").attach(json.loads(json.dumps(description)), [])
    try:
        assert worker.size == 4 * MiB and await worker.read(0, 4096) == b"w" * 4096
        await backend.resize(8 * MiB)
        worker.follow_resize(8 * MiB)
        await worker.write(8 * MiB - 4096, b"e" * 4096)
        assert await backend.read(8 * MiB - 4096, 4096) == b"e" * 4096
    finally:
        worker.close()
        assert worker.wait_closed(30)


def test_one_connection_shared_by_images(ceph_cluster: CephCluster, rbd_image: str, rbd_mod: Any) -> None:
    before = rbd_mod.shared_connections()
    a = _open(ceph_cluster, rbd_image, size=4 * MiB, create=True)
    b = _open(ceph_cluster, rbd_image)
    assert rbd_mod.shared_connections() == before + 1
    a.close()
    assert a.wait_closed(30) and rbd_mod.shared_connections() == before + 1
    b.close()
    assert b.wait_closed(30) and rbd_mod.shared_connections() == before


async def test_close_backends_waits_for_librados_shutdown(ceph_cluster: CephCluster, rbd_image: str,
                                                          rbd_mod: Any) -> None:
    """What a stopping daemon does: the image closes after librbd's last callback, then its client shuts down."""
    from target.backends.base import close_backends

    before = rbd_mod.clients_up()
    backend = _open(ceph_cluster, rbd_image, size=4 * MiB, create=True)
    assert rbd_mod.clients_up() == before + 1
    write = asyncio.ensure_future(backend.write(0, b"\x11" * 4096))
    await asyncio.sleep(0)   # the aio_write is in flight: close() has to wait for its callback
    assert await close_backends([backend], 30) == []
    await write
    assert rbd_mod.clients_up() == before


def test_exit_with_a_client_up_skips_exit_teardown(ceph_cluster: CephCluster, tmp_path: Path) -> None:
    """An image left open (librbd stuck): exit_process leaves through os._exit, so libceph-common is not torn
    down under the client's threads. The exit handler the test registers first would run after that teardown
    and keep the process there long enough for a MonClient tick to crash it (as in test_rbd_e2e.py).
    The image stays in the throwaway pool: its dead watcher keeps `rbd rm` out for 30 s."""
    image = f"t-leak-{os.getpid()}-{time.monotonic_ns()}"
    ceph_cluster.rbd("create", "--size", "4M", f"{ceph_cluster.pool}/{image}")
    script = tmp_path / "leak.py"
    script.write_text(f"""\
import ctypes, sys
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.usleep, ctypes.c_void_p), ctypes.c_void_p(4_000_000), None)
sys.path.insert(0, {str(ROOT)!r})
from target.backends import backend_class
from target.backends.base import BackendSpec
from target.backends.rbd import CephPolicy, clients_up, exit_process
spec = BackendSpec(options={{"pool": {ceph_cluster.pool!r}, "image": {image!r}}})
backend = backend_class("rbd").open(spec, CephPolicy(ceph_confs=[{str(ceph_cluster.conf)!r}]))
assert clients_up() == 1
exit_process(7)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 7, out.stderr
    assert "still up at exit" in out.stderr


async def test_closed_backend_refuses_io(ceph_cluster: CephCluster, rbd_image: str) -> None:
    backend = _open(ceph_cluster, rbd_image, size=4 * MiB, create=True)
    backend.close()
    assert backend.wait_closed(30)
    with pytest.raises(BackendError, match="closed"):
        await backend.read(0, 512)


# --- faults -------------------------------------------------------------------------------------


async def test_stopped_osd_fails_write_in_bounded_time_then_recovers(
        ceph_cluster: CephCluster, rbd_image: str) -> None:
    """An OSD that does not answer: the write fails with BackendUnavailable after the (short) op
    timeout instead of hanging; once the OSD runs again the same handle works."""
    from target.backends.rbd import RbdBackend

    backend = RbdBackend.open(BackendSpec(size=4 * MiB, create=True,
                                          options={"pool": ceph_cluster.pool, "image": rbd_image}),
                              _policy(ceph_cluster, rbd_op_timeout=2.0))   # nvmeof serve --rbd-op-timeout 2
    assert backend.op_timeout == 2.0
    try:
        await backend.write(0, b"a" * 4096)
        ceph_cluster.suspend_osd()
        try:
            with pytest.raises(BackendUnavailable, match=r"ETIMEDOUT|no answer"):
                await asyncio.wait_for(backend.write(4096, b"b" * 4096),
                                       backend.op_timeout + defaults.RBD_WAIT_MARGIN + 10)
        finally:
            ceph_cluster.resume_osd()
        await asyncio.wait_for(backend.write(8192, b"c" * 4096), 60)
        assert await backend.read(8192, 4096) == b"c" * 4096
    finally:
        backend.close()
        assert backend.wait_closed(60)


async def test_unanswered_command_capped(ceph_cluster: CephCluster, rbd_image: str, opened: Any) -> None:
    """librbd never calling back still ends the command (BackendUnavailable) after the wait limit,
    and the data handed to librbd stays referenced until it does call back."""
    backend = opened(rbd_image, size=4 * MiB, create=True)
    held: list[tuple[bytes, Callable[..., None]]] = []

    class Silent:
        def aio_write(self, data: bytes, offset: int, oncomplete: Callable[..., None]) -> object:
            held.append((data, oncomplete))
            return object()

    real, backend._image = backend._image, Silent()
    backend._wait_limit = 0.3
    try:
        with pytest.raises(BackendUnavailable, match="no answer from librbd"):
            await asyncio.wait_for(backend.write(0, b"s" * 4096), 30)
        assert len(backend._pending) == 1 and held
        _, oncomplete = held.pop()
        oncomplete(types.SimpleNamespace(get_return_value=lambda: 0))   # librbd answers late
        assert await _until(lambda: not backend._pending)
    finally:
        backend._image = real
