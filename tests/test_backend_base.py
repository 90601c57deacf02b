"""What the Backend base class gives every backend: size, read-only, range and size checks,
describe(), and can_deallocate deciding NSFEAT THIN / DLFEAT in Identify Namespace."""

from __future__ import annotations

import pytest

from nvmeof.spec import identify as idf
from nvmeof.spec.identify import IdentifyNamespace
from target.admin import identify_namespace
from target.backends import BackendError, FileBackend, NullBackend, RamBackend
from target.model import Namespace

MiB = 1 << 20


@pytest.fixture(params=["ram", "null", "file"])
def backend(request, tmp_path):
    if request.param == "ram":
        b = RamBackend(MiB)
    elif request.param == "null":
        b = NullBackend(MiB)
    else:
        b = FileBackend(tmp_path / "disk", size=MiB, create=True)
    yield b
    b.close()


async def test_size_and_resize_through_the_base(backend):
    assert backend.size == MiB and backend.read_only is False
    await backend.resize(2 * MiB)
    assert backend.size == 2 * MiB and backend.describe()["size"] == 2 * MiB
    d = backend.describe()
    assert d["kind"] == backend.kind and d["read_only"] is False


@pytest.mark.parametrize("bad", [0, -4096, 1.5, "1M"])
async def test_bad_new_size_names_the_backend_and_value(backend, bad):
    msg = rf"{backend.kind} backend.*new size must be a positive number of bytes, got {bad!r}"
    with pytest.raises(BackendError, match=msg):
        await backend.resize(bad)
    assert backend.size == MiB


@pytest.mark.parametrize("cls", [RamBackend, NullBackend])
def test_bad_size_at_creation(cls):
    with pytest.raises(BackendError, match=r"^(ram|null) backend: size must be a positive number of bytes, got 0$"):
        cls(0)


def test_file_bad_size_names_the_path(tmp_path):
    path = tmp_path / "d"
    with pytest.raises(BackendError, match=rf"^file backend {path}: size must be a positive number of bytes, got -1$"):
        FileBackend(path, size=-1, create=True)
    assert not path.exists()


async def test_range_and_read_only_checks(backend):
    with pytest.raises(BackendError, match="ends past the end"):
        await backend.write(MiB - 512, bytes(1024))
    with pytest.raises(BackendError, match="negative offset"):
        await backend.discard(-1, 512)
    with pytest.raises(BackendError, match="ends past the end"):
        await backend.read(MiB, 1)


@pytest.mark.parametrize("cls", [RamBackend, NullBackend])
async def test_read_only_refuses_before_the_range_check(cls):
    b = cls(MiB, read_only=True)
    assert b.read_only and b.describe()["read_only"] is True
    for call in (b.write(2 * MiB, b"x"), b.write_zeroes(0, 512), b.discard(0, 512)):
        with pytest.raises(BackendError, match="is read-only; writes are refused"):
            await call


def test_file_describe_adds_path_and_device(tmp_path):
    b = FileBackend(tmp_path / "disk", size=MiB, create=True)
    try:
        assert b.describe() == {"kind": "file", "path": str(tmp_path / "disk"), "size": MiB,
                                "read_only": False, "block_device": False}
    finally:
        b.close()


def test_can_deallocate_decides_thin_provisioning(tmp_path):
    assert RamBackend.can_deallocate and FileBackend.can_deallocate and not NullBackend.can_deallocate
    thin = IdentifyNamespace.parse(identify_namespace(Namespace(1, RamBackend(MiB))))
    assert thin.nsfeat & idf.NSFEAT_THIN and thin.dlfeat == 0x09
    solid = IdentifyNamespace.parse(identify_namespace(Namespace(1, NullBackend(MiB))))
    assert not solid.nsfeat & idf.NSFEAT_THIN and solid.dlfeat == 0
