"""ANA log page (0Ch) structures: build/parse/sizeof against include/linux/nvme.h, state names."""

from __future__ import annotations

import struct

import pytest

from nvmeof import defaults
from nvmeof.spec.logs import (
    ANA_LOG_RGO,
    ANA_STATE_NAMES,
    AnaGroupDescriptor,
    AnaLogHeader,
    AnaState,
    ana_log_size,
    build_ana_log,
    parse_ana_log,
    parse_ana_state,
)


def test_sizes_and_enum_match_linux_nvme_h():
    # struct nvme_ana_rsp_hdr { __le64 chgcnt; __le16 ngrps; __le16 rsvd10[3]; }
    assert AnaLogHeader.sizeof() == 16
    # struct nvme_ana_group_desc { __le32 grpid; __le32 nnsids; __le64 chgcnt; __u8 state; __u8 rsvd17[15]; }
    assert AnaGroupDescriptor.sizeof() == 32
    assert [int(s) for s in AnaState] == [0x01, 0x02, 0x03, 0x04, 0x0F]
    assert ANA_LOG_RGO == 1
    assert ana_log_size(defaults.ANAGRPMAX, defaults.MAX_NAMESPACES) == 16 + 128 * 32 + 1024 * 4


def test_build_places_every_field_at_its_offset():
    page = build_ana_log(0x1122334455667788, [(7, 0xAABB, AnaState.INACCESSIBLE, [3, 9]),
                                              (9, 5, AnaState.OPTIMIZED, [1])])
    assert len(page) == 16 + 32 + 8 + 32 + 4
    chgcnt, ngrps = struct.unpack_from("<QH", page, 0)
    assert (chgcnt, ngrps) == (0x1122334455667788, 2)
    assert page[10:16] == bytes(6)
    grpid, nnsids, grp_chgcnt, state = struct.unpack_from("<IIQB", page, 16)
    assert (grpid, nnsids, grp_chgcnt, state) == (7, 2, 0xAABB, 0x03)
    assert page[33:48] == bytes(15)
    assert struct.unpack_from("<II", page, 48) == (3, 9)
    assert struct.unpack_from("<IIQB", page, 56) == (9, 1, 5, 0x01)
    assert struct.unpack_from("<I", page, 88) == (1,)


def test_rgo_leaves_out_the_nsid_lists():
    page = build_ana_log(3, [(1, 0, AnaState.OPTIMIZED, [1, 2, 3]), (2, 1, AnaState.CHANGE, [4])], rgo=True)
    assert len(page) == 16 + 2 * 32
    log = parse_ana_log(page)
    assert [(g.anagrpid, g.state, g.nsids) for g in log.groups] == [(1, AnaState.OPTIMIZED, []),
                                                                    (2, AnaState.CHANGE, [])]


def test_parse_round_trip_and_zero_padding():
    groups = [(1, 4, AnaState.NON_OPTIMIZED, [1, 5]), (2, 0, AnaState.PERSISTENT_LOSS, [2])]
    page = build_ana_log(10, groups)
    log = parse_ana_log(page + bytes(100))   # the host reads its whole buffer: the rest is zeros
    assert log.chgcnt == 10
    assert [(g.anagrpid, g.chgcnt, g.state, g.nsids) for g in log.groups] == [
        (1, 4, AnaState.NON_OPTIMIZED, [1, 5]), (2, 0, AnaState.PERSISTENT_LOSS, [2])]
    assert log.states() == {1: AnaState.NON_OPTIMIZED, 2: AnaState.PERSISTENT_LOSS}


def test_parse_refuses_truncated_or_invalid_logs():
    page = build_ana_log(1, [(1, 0, AnaState.OPTIMIZED, [1, 2])])
    with pytest.raises(ValueError, match="shorter than its 16-byte header"):
        parse_ana_log(page[:8])
    with pytest.raises(ValueError, match="descriptor 0 of 1 runs past"):
        parse_ana_log(page[:30])
    with pytest.raises(ValueError, match="lists 2 NSIDs past"):
        parse_ana_log(page[:-4])
    zero = bytearray(page)
    zero[16:20] = bytes(4)
    with pytest.raises(ValueError, match="invalid group id 0"):
        parse_ana_log(bytes(zero))
    reserved = bytearray(page)
    reserved[32] = 0x07   # a reserved state value is kept as a number, not refused
    assert parse_ana_log(bytes(reserved)).groups[0].state == 7


def test_build_refuses_bad_input():
    with pytest.raises(ValueError, match="ANA group id 0"):
        build_ana_log(0, [(0, 0, AnaState.OPTIMIZED, [1])])
    with pytest.raises(ValueError, match="NSID 0"):
        build_ana_log(0, [(1, 0, AnaState.OPTIMIZED, [0])])


def test_state_names():
    assert list(ANA_STATE_NAMES.values()) == ["optimized", "non-optimized", "inaccessible", "persistent-loss",
                                              "change"]
    for state, name in ANA_STATE_NAMES.items():
        assert parse_ana_state(name) is state
        assert parse_ana_state(name.upper().replace("-", "_")) is state
        assert parse_ana_state(state) is state
    with pytest.raises(ValueError, match="is not one of: optimized, non-optimized, inaccessible"):
        parse_ana_state("standby")
    with pytest.raises(ValueError):
        parse_ana_state(3)
