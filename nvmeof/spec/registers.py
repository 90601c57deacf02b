"""Controller properties read and written with Fabrics Property Get/Set: CAP, VS, CC, CSTS.

NVMe Base Specification 2.0 §3.1.4; include/linux/nvme.h ``NVME_CC_*``, ``NVME_CSTS_*``, ``NVME_CAP_*``.
Both the target (which holds them) and the initiator (which drives them) use these.
"""

from __future__ import annotations

# CC: Controller Configuration
CC_EN = 1 << 0
CC_CSS_SHIFT, CC_CSS_MASK = 4, 0x7
CC_MPS_SHIFT, CC_MPS_MASK = 7, 0xF
CC_AMS_SHIFT, CC_AMS_MASK = 11, 0x7
CC_SHN_SHIFT, CC_SHN_MASK = 14, 0x3
CC_IOSQES_SHIFT, CC_IOCQES_SHIFT, CC_QES_MASK = 16, 20, 0xF
CC_CSS_NVM = 0 << CC_CSS_SHIFT
CC_CSS_CSI = 6 << CC_CSS_SHIFT
CC_AMS_RR = 0 << CC_AMS_SHIFT
CC_SHN_NORMAL = 1 << CC_SHN_SHIFT
NVM_IOSQES = 6   # 2**6 = 64-byte SQE
NVM_IOCQES = 4   # 2**4 = 16-byte CQE
CC_IOSQES = NVM_IOSQES << CC_IOSQES_SHIFT
CC_IOCQES = NVM_IOCQES << CC_IOCQES_SHIFT

# CSTS: Controller Status
CSTS_RDY = 1 << 0
CSTS_CFS = 1 << 1
CSTS_SHST_MASK = 3 << 2
CSTS_SHST_CMPLT = 2 << 2

# CAP: Controller Capabilities
CAP_CQR = 1 << 16
CAP_CSS_NVM = 1 << 37
CAP_CSS_CSI = 1 << 43


def cap_mqes(cap: int) -> int:
    """Maximum queue entries supported, 0's based."""
    return cap & 0xFFFF


def cap_timeout_s(cap: int) -> float:
    """Ready timeout as the Linux host computes it: (CAP.TO + 1) * 500 ms."""
    return (((cap >> 24) & 0xFF) + 1) * 0.5


def cap_mpsmin(cap: int) -> int:
    return (cap >> 48) & 0xF
