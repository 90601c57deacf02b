"""The throwaway Ceph cluster the RBD tests use (tests/ceph_cluster.py, scripts/ceph-cluster)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.ceph_cluster import CephCluster, CephClusterError, unusable_reason

pytestmark = pytest.mark.ceph
ROOT = Path(__file__).resolve().parent.parent


def test_session_cluster_serves_rbd(ceph_cluster: CephCluster, rbd_image: str) -> None:
    assert "HEALTH_OK" in ceph_cluster.ceph("health")
    ceph_cluster.rbd("create", "--size", "4M", f"{ceph_cluster.pool}/{rbd_image}")
    assert ceph_cluster.rbd_bytes("export", "--no-progress", f"{ceph_cluster.pool}/{rbd_image}", "-") == bytes(4 << 20)
    assert str(ceph_cluster.directory) in ceph_cluster.conf.read_text()
    assert "/etc/ceph" not in ceph_cluster.conf.read_text() and "/var/lib/ceph" not in ceph_cluster.conf.read_text()


def test_command_failure_names_command_and_error(ceph_cluster: CephCluster) -> None:
    with pytest.raises(CephClusterError, match=r"rbd .*info.*failed.*No such file"):
        ceph_cluster.rbd("info", f"{ceph_cluster.pool}/no-such-image")


@pytest.mark.slow
def test_script_runs_a_second_cluster_beside_the_first(ceph_cluster: CephCluster, tmp_path: Path) -> None:
    """scripts/ceph-cluster start/status/stop in another directory while the session's cluster runs:
    free ports, its own files, and stop removes what start created but nothing else."""
    directory = tmp_path / "laptop"
    directory.mkdir()
    (directory / "mine.txt").write_text("keep me")
    script = str(ROOT / "scripts" / "ceph-cluster")
    try:
        out = subprocess.run([script, "start", str(directory)], capture_output=True, text=True, timeout=150,
                             check=True).stdout
        assert f"export CEPH_CONF={directory / 'ceph.conf'}" in out
        second = CephCluster(directory)
        assert second.conf.read_text() != ceph_cluster.conf.read_text()
        status = subprocess.run([script, "status", str(directory)], capture_output=True, text=True, timeout=60,
                                check=False)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "HEALTH_OK" in status.stdout
        again = subprocess.run([script, "start", str(directory)], capture_output=True, text=True, timeout=60,
                               check=False)
        assert again.returncode != 0 and "already holds" in again.stderr
        assert all(second.running().values())   # a refused start leaves the running cluster alone
        assert "HEALTH_OK" in ceph_cluster.ceph("health")   # the first cluster is untouched
    finally:
        subprocess.run([script, "stop", str(directory)], capture_output=True, text=True, timeout=60, check=False)
    assert sorted(p.name for p in directory.iterdir()) == ["mine.txt"]


def test_unusable_reason_is_none_here_or_names_packages() -> None:
    reason = unusable_reason()
    assert reason is None or "apt-get install" in reason


def test_suspend_osd_returns_once_every_thread_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill(SIGSTOP) returns before the threads have stopped; suspend_osd waits until /proc shows all stopped
    (a stand-in OSD with threads; the first looks of the state see one still running)."""
    import sys

    from tests import ceph_cluster

    code = "import threading, time\nfor _ in range(8): threading.Thread(target=time.sleep, args=(60,)).start()\n" \
           "print('up', flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        cluster = CephCluster(tmp_path)
        cluster._procs["osd.0"], cluster._pids["osd.0"] = proc, proc.pid
        real, looks = ceph_cluster.thread_states, []

        def states(pid: int) -> list[str]:
            looks.append(pid)
            return ["R", *real(pid)] if len(looks) < 3 else real(pid)

        monkeypatch.setattr(ceph_cluster, "thread_states", states)
        cluster.suspend_osd()
        assert len(looks) >= 3 and set(real(proc.pid)) <= {"T", "t"} and len(real(proc.pid)) == 9
        cluster.resume_osd()
    finally:
        proc.kill()
        proc.wait()
