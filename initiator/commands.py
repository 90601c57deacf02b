"""Submission queue entries the host sends, built from their NVMe field names.

Fabrics SQEs are built with the construct layouts in nvmeof/spec/fabrics.py; admin and I/O commands
set the CDWs as NVMe Base 2.0 §5 and the NVM Command Set 1.0 §3 define them (Linux
include/linux/nvme.h ``struct nvme_rw_command``, ``nvme_get_log_page_command``, ...).
"""

from __future__ import annotations

from nvmeof.spec.auth import SECP_DHCHAP, SPSP0_DHCHAP, SPSP1_DHCHAP  # as nvme_auth_submit sets them
from nvmeof.spec.fabrics import (
    CATTR_DISABLE_SQFLOW,
    CONNECT_DATA_SIZE,
    NVMF_NQN_SIZE,
    PROPERTY_SIZE_8,
    AuthReceiveCommand,
    AuthSendCommand,
    ConnectCommand,
    ConnectData,
    PropertyGetCommand,
    PropertySetCommand,
)
from nvmeof.spec.nvme import (
    DSM_AD,
    NSID_ALL,
    RW_FUA,
    WZ_DEAC,
    AdminOpcode,
    Command,
    FabricsType,
    IoOpcode,
)
from nvmeof.spec.registers import (  # noqa: F401  (re-exported for the controller module)
    CAP_CSS_CSI,
    CAP_CSS_NVM,
    CC_AMS_RR,
    CC_CSS_CSI,
    CC_CSS_NVM,
    CC_EN,
    CC_IOCQES,
    CC_IOSQES,
    CC_MPS_SHIFT,
    CC_SHN_MASK,
    CC_SHN_NORMAL,
    CSTS_CFS,
    CSTS_RDY,
    CSTS_SHST_CMPLT,
    CSTS_SHST_MASK,
    cap_mpsmin,
    cap_mqes,
    cap_timeout_s,
)
from nvmeof.spec.reservations import (
    ACTION_MASK,
    CPTPL_SHIFT,
    IEKEY,
    REPORT_EDS,
    RTYPE_SHIFT,
    AcquireData,
    RegisterData,
    ReleaseData,
)

# Connect response DW0
CONNECT_AUTHREQ_ATR = 1 << 17
CONNECT_AUTHREQ_ASCR = 1 << 18



def check_nqn(name: str, nqn: str) -> None:
    raw = nqn.encode("utf-8")
    if not raw or len(raw) > NVMF_NQN_SIZE:
        raise ValueError(f"{name} {nqn!r} must be 1..{NVMF_NQN_SIZE} bytes of UTF-8, got {len(raw)}")


def connect(qid: int, sqsize: int, *, kato_ms: int = 0, disable_sqflow: bool = False) -> Command:
    raw = ConnectCommand.build({
        "rsvd1": 0, "cid": 0, "fctype": FabricsType.CONNECT, "rsvd2": bytes(19), "dptr": bytes(16),
        "recfmt": 0, "qid": qid, "sqsize": sqsize, "cattr": CATTR_DISABLE_SQFLOW if disable_sqflow else 0,
        "rsvd3": 0, "kato": kato_ms, "rsvd4": bytes(12),
    })
    return Command.from_bytes(raw)


def connect_data(hostid: bytes, cntlid: int, subnqn: str, hostnqn: str) -> bytes:
    check_nqn("subsystem NQN", subnqn)
    check_nqn("host NQN", hostnqn)
    if len(hostid) != 16:
        raise ValueError(f"hostid must be 16 bytes, got {len(hostid)}")
    data = ConnectData.build({"hostid": hostid, "cntlid": cntlid, "subsysnqn": subnqn, "hostnqn": hostnqn})
    assert len(data) == CONNECT_DATA_SIZE
    return data


def auth_send(tl: int) -> Command:
    """Authentication Send of ``tl`` bytes of DH-HMAC-CHAP message (data out)."""
    raw = AuthSendCommand.build({
        "rsvd1": 0, "cid": 0, "fctype": FabricsType.AUTH_SEND, "rsvd2": bytes(19), "dptr": bytes(16),
        "rsvd3": 0, "spsp0": SPSP0_DHCHAP, "spsp1": SPSP1_DHCHAP, "secp": SECP_DHCHAP, "tl": tl, "rsvd4": bytes(16),
    })
    return Command.from_bytes(raw)


def auth_receive(al: int) -> Command:
    """Authentication Receive into a buffer of ``al`` bytes (data in)."""
    raw = AuthReceiveCommand.build({
        "rsvd1": 0, "cid": 0, "fctype": FabricsType.AUTH_RECEIVE, "rsvd2": bytes(19), "dptr": bytes(16),
        "rsvd3": 0, "spsp0": SPSP0_DHCHAP, "spsp1": SPSP1_DHCHAP, "secp": SECP_DHCHAP, "al": al, "rsvd4": bytes(16),
    })
    return Command.from_bytes(raw)


def property_get(offset: int, size: int) -> Command:
    raw = PropertyGetCommand.build({
        "rsvd1": 0, "cid": 0, "fctype": FabricsType.PROPERTY_GET, "rsvd2": bytes(35),
        "attrib": PROPERTY_SIZE_8 if size == 8 else 0, "rsvd3": bytes(3), "offset": offset,
        "rsvd4": bytes(16),
    })
    return Command.from_bytes(raw)


def property_set(offset: int, value: int, size: int) -> Command:
    raw = PropertySetCommand.build({
        "rsvd1": 0, "cid": 0, "fctype": FabricsType.PROPERTY_SET, "rsvd2": bytes(35),
        "attrib": PROPERTY_SIZE_8 if size == 8 else 0, "rsvd3": bytes(3), "offset": offset,
        "value": value, "rsvd4": bytes(8),
    })
    return Command.from_bytes(raw)


def identify(cns: int, *, nsid: int = 0, cntid: int = 0, csi: int = 0) -> Command:
    return Command(AdminOpcode.IDENTIFY, nsid=nsid, cdw10=cns | (cntid << 16), cdw11=csi << 24)


def get_log_page(lid: int, length: int, *, offset: int = 0, nsid: int = NSID_ALL, rae: bool = False,
                 lsp: int = 0, lsi: int = 0, csi: int = 0) -> Command:
    if length <= 0 or length % 4:
        raise ValueError(f"log page length must be a positive multiple of 4, got {length}")
    if offset % 4:
        raise ValueError(f"log page offset must be dword aligned, got {offset}")
    numd = length // 4 - 1
    return Command(
        AdminOpcode.GET_LOG_PAGE, nsid=nsid,
        cdw10=lid | ((lsp & 0x7F) << 8) | (int(rae) << 15) | ((numd & 0xFFFF) << 16),
        cdw11=(numd >> 16) | (lsi << 16),
        cdw12=offset & 0xFFFFFFFF, cdw13=offset >> 32, cdw14=csi << 24,
    )


def get_features(fid: int, *, sel: int = 0, cdw11: int = 0, nsid: int = 0) -> Command:
    return Command(AdminOpcode.GET_FEATURES, nsid=nsid, cdw10=fid | ((sel & 7) << 8), cdw11=cdw11)


def set_features(fid: int, cdw11: int = 0, *, save: bool = False, nsid: int = 0, cdw12: int = 0,
                 cdw13: int = 0, cdw14: int = 0, cdw15: int = 0) -> Command:
    return Command(AdminOpcode.SET_FEATURES, nsid=nsid, cdw10=fid | (int(save) << 31), cdw11=cdw11,
                   cdw12=cdw12, cdw13=cdw13, cdw14=cdw14, cdw15=cdw15)


def keep_alive() -> Command:
    return Command(AdminOpcode.KEEP_ALIVE)


def async_event_request() -> Command:
    return Command(AdminOpcode.ASYNC_EVENT_REQUEST)


def rw(opcode: int, nsid: int, slba: int, nlb: int, *, fua: bool = False) -> Command:
    """Read, Write or Compare of ``nlb`` blocks (1..65536) at ``slba``."""
    return Command(opcode, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                   cdw12=(nlb - 1) | (RW_FUA if fua else 0))


def write_zeroes(nsid: int, slba: int, nlb: int, *, deallocate: bool = False) -> Command:
    return Command(IoOpcode.WRITE_ZEROES, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                   cdw12=(nlb - 1) | (WZ_DEAC if deallocate else 0))


def flush(nsid: int) -> Command:
    return Command(IoOpcode.FLUSH, nsid=nsid)


def dataset_management(nsid: int, nr: int, *, attributes: int = DSM_AD) -> Command:
    return Command(IoOpcode.DATASET_MANAGEMENT, nsid=nsid, cdw10=nr - 1, cdw11=attributes)


# ---- reservations (NVM Command Set; libnvme nvme_init_resv_register/_acquire/_release/_report) ----------
# Each builder returns the SQE and the data it carries out (CRKEY, then NRKEY or PRKEY, little-endian).

def _key(name: str, value: int) -> int:
    if not 0 <= value < 1 << 64:
        raise ValueError(f"{name} must be a 64-bit key (0..2**64-1), got {value}")
    return value


def _field(name: str, value: int, top: int) -> int:
    if not 0 <= value <= top:
        raise ValueError(f"{name} must be 0..{top}, got {value}")
    return int(value)


def resv_register(nsid: int, *, rrega: int, crkey: int = 0, nrkey: int = 0, iekey: bool = False,
                  cptpl: int = 0) -> tuple[Command, bytes]:
    """Reservation Register: CDW10 RREGA 2:0, IEKEY 3, CPTPL 31:30."""
    cdw10 = (_field("rrega", rrega, ACTION_MASK) | (IEKEY if iekey else 0)
             | (_field("cptpl", cptpl, 3) << CPTPL_SHIFT))
    data = RegisterData.build({"crkey": _key("crkey", crkey), "nrkey": _key("nrkey", nrkey)})
    return Command(IoOpcode.RESV_REGISTER, nsid=nsid, cdw10=cdw10), data


def resv_acquire(nsid: int, *, racqa: int, rtype: int, crkey: int = 0, prkey: int = 0,
                 iekey: bool = False) -> tuple[Command, bytes]:
    """Reservation Acquire: CDW10 RACQA 2:0, IEKEY 3, RTYPE 15:8."""
    cdw10 = (_field("racqa", racqa, ACTION_MASK) | (IEKEY if iekey else 0)
             | (_field("rtype", rtype, 0xFF) << RTYPE_SHIFT))
    data = AcquireData.build({"crkey": _key("crkey", crkey), "prkey": _key("prkey", prkey)})
    return Command(IoOpcode.RESV_ACQUIRE, nsid=nsid, cdw10=cdw10), data


def resv_release(nsid: int, *, rrela: int, rtype: int = 0, crkey: int = 0,
                 iekey: bool = False) -> tuple[Command, bytes]:
    """Reservation Release: CDW10 RRELA 2:0, IEKEY 3, RTYPE 15:8."""
    cdw10 = (_field("rrela", rrela, ACTION_MASK) | (IEKEY if iekey else 0)
             | (_field("rtype", rtype, 0xFF) << RTYPE_SHIFT))
    data = ReleaseData.build({"crkey": _key("crkey", crkey)})
    return Command(IoOpcode.RESV_RELEASE, nsid=nsid, cdw10=cdw10), data


def resv_report(nsid: int, length: int, *, eds: bool = True) -> Command:
    """Reservation Report into ``length`` bytes: CDW10 NUMD (dwords, 0's based), CDW11 bit 0 EDS."""
    if length <= 0 or length % 4 or length > 4 << 32:
        raise ValueError(f"reservation report length must be a positive multiple of 4 bytes up to 16 GiB, "
                         f"got {length}")
    return Command(IoOpcode.RESV_REPORT, nsid=nsid, cdw10=length // 4 - 1, cdw11=REPORT_EDS if eds else 0)
