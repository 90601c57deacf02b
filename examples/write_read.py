"""Write data through the Python initiator and read it back (the blocking API, for scripts).

    NVMEOF_TRADDR=127.0.0.1 NVMEOF_TRSVCID=4420 NVMEOF_NQN=nqn... python3 examples/write_read.py
"""

from __future__ import annotations

import hashlib
import os

import initiator.sync as nvmf

TRADDR = os.environ.get("NVMEOF_TRADDR", "127.0.0.1")
TRSVCID = int(os.environ.get("NVMEOF_TRSVCID", "4420"))
NQN = os.environ.get("NVMEOF_NQN", "nqn.2026-11.io.nvmeof-toolkit:example")


def main() -> None:
    with nvmf.connect(TRADDR, TRSVCID, subnqn=NQN, nr_io_queues=2) as ctrl:
        idc = ctrl.identify_controller()
        print(f"connected to {idc['subnqn']} ({idc['mn']}), cntlid {idc['cntlid']}")
        nsid = ctrl.namespaces()[0]
        ns = ctrl.identify_namespace(nsid)
        block = 1 << ns["lbaf"][ns["flbas"] & 0xF]["lbads"]
        print(f"namespace {nsid}: {ns['nsze']} blocks of {block} bytes")

        data = os.urandom(1 << 20)                      # 1 MiB, split by the library as MDTS requires
        ctrl.write(nsid, 0, data)
        ctrl.flush(nsid)
        back = ctrl.read(nsid, 0, len(data) // block)
        assert back == data, "read-back does not match what was written"
        print(f"wrote and read back 1 MiB, sha256 {hashlib.sha256(back).hexdigest()[:16]}...: match")


if __name__ == "__main__":
    main()
