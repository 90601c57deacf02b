"""The backend registry (issue 11 item 4): a backend is one class plus one registry line.

A test-only backend defined here is registered without touching target/backends, opened through
``open_backend`` and the management service, described and attached as a worker does, and served
by a real `serve --workers 1` worker process over NVMe/TCP.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import initiator
from initiator import commands as c
from nvmeof import defaults
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.uri import TransportAddress
from target.backends import (
    BACKEND_OPTIONS,
    BACKENDS,
    KINDS,
    attach_backend,
    backend_class,
    open_backend,
    register_backend,
)
from target.backends.base import BackendError, BackendSpec, close_fds
from target.backends.null import NullBackend
from target.backends.ram import RamBackend
from target.config import load_config
from target.core import Target
from target.fields import Field
from target.service import ServiceError, TargetService
from target.workers import PooledTarget
from tests.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
NQN = defaults.DEFAULT_SUBSYSTEM_NQN
MiB = 1 << 20


class LbaStampBackend(NullBackend):
    """Every 512-byte block reads as its LBA's low byte plus ``seed``; writes are dropped (as null)."""

    kind = "lbastamp"
    default_seed = 0

    def __init__(self, size: int, *, read_only: bool = False, seed: int | None = None) -> None:
        super().__init__(size, read_only=read_only)
        self.seed = self.default_seed if seed is None else seed

    def _block(self, offset: int, length: int) -> bytes:
        return bytes(((offset + i) // 512 + self.seed) & 0xFF for i in range(length))

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self._check_range(offset, len(buf))
        buf[:] = self._block(offset, len(buf))

    async def read(self, offset: int, length: int) -> bytes:
        self._check_range(offset, length)
        return self._block(offset, length)

    # what makes it servable by worker processes
    def describe_for_worker(self) -> tuple[dict[str, Any], list[int]]:
        return {**self.describe(), "seed": self.seed}, []

    @classmethod
    def attach(cls, description: dict[str, Any], fds: list[int]) -> LbaStampBackend:
        close_fds(fds)
        return cls(description["size"], read_only=description["read_only"], seed=description["seed"])


@pytest.fixture
def registered():
    register_backend("lbastamp", LbaStampBackend)
    try:
        yield
    finally:
        BACKENDS.pop("lbastamp", None)


async def test_a_registered_backend_opens_and_round_trips_through_describe_attach(registered) -> None:
    assert KINDS == ("file", "ram", "null", "rbd")   # the shipped kinds are untouched
    with pytest.raises(ValueError, match="already registered"):
        register_backend("lbastamp", LbaStampBackend)
    ours = open_backend("lbastamp", size=MiB)
    assert isinstance(ours, LbaStampBackend) and ours.size == MiB
    with pytest.raises(BackendError, match="takes no path"):
        open_backend("lbastamp", path="/x", size=MiB)
    ours.seed = 9
    description, fds = ours.describe_for_worker()
    theirs = attach_backend(description, fds)
    assert isinstance(theirs, LbaStampBackend) and theirs is not ours
    assert bytes(await theirs.read(512 * 3, 4)) == bytes([12] * 4)


def test_lazy_entries_import_when_first_used_and_say_what_is_missing() -> None:
    BACKENDS["lazy-null"] = "target.backends.null:NullBackend"
    BACKENDS["missing"] = "no_such_package_for_rbd:RbdBackend"
    try:
        from target.backends.null import NullBackend

        assert backend_class("lazy-null") is NullBackend
        with pytest.raises(BackendError, match=r"the missing backend cannot be loaded.*no_such_package_for_rbd"):
            open_backend("missing", size=MiB)
    finally:
        BACKENDS.pop("lazy-null")
        BACKENDS.pop("missing")


def test_an_unknown_kind_from_a_worker_message_closes_its_descriptors() -> None:
    r, w = os.pipe()
    with pytest.raises(BackendError, match="unknown backend kind 'tape'"):
        attach_backend({"kind": "tape", "size": MiB, "read_only": False}, [r])
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)


@pytest.mark.skipif(not hasattr(os, "memfd_create") or sys.platform != "linux",
                    reason="worker processes need Linux memfd and SCM_RIGHTS")
async def test_a_registered_backend_is_served_by_a_worker_process(registered, tmp_path, monkeypatch) -> None:
    # The worker is a fresh interpreter: it learns the test backend the way a deployment would learn a
    # plugin, by a registry line run before target.worker starts (here as a lazy "module:Class" entry).
    wrapper = tmp_path / "python"
    code = (f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from target.backends import register_backend; "
            "register_backend('lbastamp', 'tests.test_backend_registry:LbaStampBackend'); "
            "assert sys.argv[1:3] == ['-m', 'target.worker'], sys.argv; del sys.argv[1:3]; "
            "runpy.run_module('target.worker', run_name='__main__', alter_sys=True)")
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{code}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(wrapper))
    io, disc = free_ports(2)
    daemon = Daemon(DaemonOptions(listen=[TransportAddress("tcp", "127.0.0.1", io)],
                                  discovery=[TransportAddress("tcp", "127.0.0.1", disc)],
                                  api=None, ramdisk_size=MiB, workers=1, backing_dirs=[tmp_path]))
    try:
        await daemon.start()
        assert isinstance(daemon.target, PooledTarget)
        # Only in this process: a worker reads this seed only if it attached from the description.
        monkeypatch.setattr(LbaStampBackend, "default_seed", 0x40)
        ns = await daemon.service.add_namespace(NQN, backend="lbastamp", size=MiB, nsid=2)
        assert isinstance(ns.backend, LbaStampBackend) and ns.backend.seed == 0x40
        async with initiator.connect("127.0.0.1", io, NQN, timeout=10, nr_io_queues=1) as ctrl:
            placement = daemon.target.pool.placement()
            assert placement[(ctrl.cntlid, 1)] in daemon.target.pool.pids()
            buf = bytearray(2 * 512)
            await ctrl.io_queues[0].submit(c.rw(0x02, 2, 5, 2), data_in=buf)
            assert bytes(buf) == bytes([5 + 0x40] * 512 + [6 + 0x40] * 512)
    finally:
        await daemon.stop()


# --- a kind the service learns from its class alone -------------------------------------------------


class TapePolicy:
    """The toy kind's part of the operator's policy: which tape libraries its namespaces may name."""

    settings = ("tape_libraries",)

    def __init__(self, tape_libraries: tuple[str, ...] = ()) -> None:
        self.tape_libraries = tuple(tape_libraries)

    def widened(self, tape_libraries: tuple[str, ...] = ()) -> TapePolicy:
        return TapePolicy((*self.tape_libraries, *tape_libraries))

    def widens(self, tape_libraries: tuple[str, ...] = ()) -> list[str]:
        return [lib for lib in tape_libraries if lib not in self.tape_libraries]


class TapeBackend(RamBackend):
    """A RAM disk standing for a slot of a tape library: two namespaces on one slot share storage."""

    kind = "tape"
    policy_class = TapePolicy

    @classmethod
    def validate_spec(cls, spec: BackendSpec, policy: Any = None) -> BackendSpec:
        spec = super().validate_spec(spec, policy)
        if "library" not in spec.options:
            raise BackendError("a tape namespace needs a library")
        allowed = policy.tape_libraries if policy is not None else ()
        if spec.options["library"] not in allowed:
            raise BackendError(f"tape library {spec.options['library']} is not allowed (allowed: {allowed})")
        return spec

    @classmethod
    def storage_key(cls, spec: BackendSpec, policy: Any = None) -> Any:
        return ("tape", spec.options["library"], spec.options.get("slot", "0"))

    @classmethod
    def storage_name(cls, spec: BackendSpec) -> str:
        return f"slot {spec.options.get('slot', '0')} of tape library {spec.options['library']}"


@pytest.fixture
def tape():
    register_backend("tape", TapeBackend, options={"library": Field(str, min_length=1),   # the one line
                                                   "slot": Field(str, min_length=1)})
    try:
        yield
    finally:
        BACKENDS.pop("tape", None)
        BACKEND_OPTIONS.pop("tape", None)


async def test_a_registered_kind_is_validated_fenced_and_kept_by_the_service(tape, tmp_path) -> None:
    # Nothing in target/ names this kind: the service takes its policy setting, checks its settings,
    # refuses a second namespace on its storage and writes its settings to the configuration file.
    cfg = tmp_path / "config.json"
    svc = TargetService(Target(), config_path=cfg, backing_dirs=[tmp_path], tape_libraries=["lib0"])
    sub = (await svc.add_subsystem(NQN)).nqn
    ns = await svc.add_namespace(sub, backend="tape", size=MiB, options={"library": "lib0", "slot": "3"})
    assert isinstance(ns.backend, TapeBackend) and ns.backend.size == MiB
    with pytest.raises(ServiceError, match="slot 3 of tape library lib0 already backs namespace 1") as err:
        await svc.add_namespace(sub, backend="tape", size=MiB, options={"library": "lib0", "slot": "3"})
    assert err.value.status == 409
    await svc.add_namespace(sub, backend="tape", size=MiB, options={"library": "lib0", "slot": "4"})
    for options, message in (({"library": "lib9"}, "tape library lib9 is not allowed"),
                             ({"library": "lib0", "colour": "red"}, "tape namespace has no setting colour"),
                             ({"library": "lib0", "pool": "rbd"}, "tape namespace has no setting pool")):
        with pytest.raises(ServiceError, match=message) as err:
            await svc.add_namespace(sub, backend="tape", size=MiB, options=options)
        assert err.value.status == 400
    with pytest.raises(ServiceError, match="a file namespace has no setting library"):
        await svc.add_namespace(sub, backend="file", path=str(tmp_path / "f"), size=MiB, create=True,
                                options={"library": "lib0"})
    saved = load_config(cfg)["subsystems"][0]["namespaces"]
    assert [(n["backend"], n["library"], n["slot"]) for n in saved] == [("tape", "lib0", "3"), ("tape", "lib0", "4")]

    # a restart replays the file through the same checks
    again = TargetService(Target(), config_path=cfg, backing_dirs=[tmp_path], tape_libraries=["lib0"])
    assert await again.restore(load_config(cfg)) == []
    assert [n.spec["slot"] for n in again.list_namespaces(sub)] == ["3", "4"]
    with pytest.raises(TypeError, match="no backend takes the policy setting"):
        TargetService(Target(), tape_drives=["x"])


def test_a_setting_two_kinds_name_is_declared_alike() -> None:
    # the file and the REST body have one field per name: a second kind may share rbd's "pool" only as declared
    pool = BACKEND_OPTIONS["rbd"]["pool"]
    with pytest.raises(ValueError, match="declares setting 'pool' unlike another kind"):
        register_backend("tape", TapeBackend, options={"pool": Field(str, max_length=pool.max_length + 1)})
    assert "tape" not in BACKENDS and "tape" not in BACKEND_OPTIONS
    register_backend("tape", TapeBackend, options={"pool": pool})
    try:
        assert BACKEND_OPTIONS["tape"]["pool"] is pool
    finally:
        BACKENDS.pop("tape", None)
        BACKEND_OPTIONS.pop("tape", None)
