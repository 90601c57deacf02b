"""nvme-cli-style output for the command line: ``-o normal|json`` with nvme-cli's field names and values.

Each JSON shape follows one function of nvme-cli's src/nvme-print-json.c and each normal text one of
src/nvme-print-stdout.c (named at each). Number-to-name tables live in nvmeof.spec (fabrics.py for the
discovery log, nvme.py for features); this module only arranges them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import click

from nvmeof.spec import fabrics
from nvmeof.spec.fabrics import TrType, TsasRdma
from nvmeof.spec.nvme import FEATURE_NAMES, SELECT_NAMES

OUTPUT_FORMATS = ("normal", "json")


def output_format_options(f: Callable) -> Callable:
    """nvme-cli's ``-o/--output-format normal|json``; ``--json`` stays as the same switch."""
    f = click.option("--json", "as_json", is_flag=True, help="Same as -o json.")(f)
    return click.option("-o", "--output-format", "output_format", type=click.Choice(OUTPUT_FORMATS),
                        default="normal", show_default=True,
                        help="Output format, as nvme-cli's -o: normal text or JSON with nvme-cli's field names.")(f)


def wants_json(output_format: str, as_json: bool) -> bool:
    return as_json or output_format == "json"


# -- discovery log: json_discovery_log / stdout_discovery_log ---------------------------------------


def _tsas_fields(trtype: int, tsas: bytes) -> list[tuple[str, object]]:
    """The TSAS fields nvme-cli shows for RDMA and TCP entries (none for other transports)."""
    if trtype == TrType.RDMA:
        t = TsasRdma.parse(bytes(tsas).ljust(256, b"\0"))
        return [("rdma_prtype", fabrics.prtype_str(t.prtype)), ("rdma_qptype", fabrics.qptype_str(t.qptype)),
                ("rdma_cms", fabrics.cms_str(t.cms)), ("rdma_pkey", t.pkey)]
    if trtype == TrType.TCP:
        return [("sectype", fabrics.sectype_str(tsas[0] if tsas else 0))]
    return []


def discovery_record(e: Any) -> dict[str, object]:
    """One discovery log entry as nvme-cli's JSON record (values named, ports and addresses trimmed)."""
    record: dict[str, object] = {
        "trtype": fabrics.trtype_str(e.trtype), "adrfam": fabrics.adrfam_str(e.adrfam),
        "subtype": fabrics.subtype_str(e.subtype), "treq": fabrics.treq_str(e.treq), "portid": e.portid,
        "trsvcid": e.trsvcid.strip(), "subnqn": e.subnqn.strip(), "traddr": e.traddr.strip(),
        "eflags": fabrics.eflags_str(e.eflags),
    }
    record.update(_tsas_fields(e.trtype, e.tsas))
    return record


def discovery_log_json(genctr: int, entries: Sequence[Any]) -> dict[str, object]:
    return {"genctr": genctr, "records": [discovery_record(e) for e in entries]}


def discovery_log_text(genctr: int, entries: Sequence[Any]) -> str:
    lines = ["", f"Discovery Log Number of Records {len(entries)}, Generation counter {genctr}"]
    for i, e in enumerate(entries):
        r = discovery_record(e)
        lines.append(f"=====Discovery Log Entry {i}======")
        for key in ("trtype", "adrfam", "subtype", "treq", "portid", "trsvcid", "subnqn", "traddr", "eflags"):
            value = r[key] if key != "adrfam" or r["traddr"] else ""  # no address: nvme-cli leaves adrfam empty
            lines.append(f"{key + ':':<8} {value}")
        for key, value in _tsas_fields(e.trtype, e.tsas):
            if key == "rdma_pkey":
                value = c_hex(value, 4)
            lines.append(f"{key}: {value}" if key.startswith("rdma") else f"{key + ':':<8} {value}")
    return "\n".join(lines)


# -- identify: json_nvme_id_ctrl / json_nvme_id_ns ----------------------------------------------------

# json_nvme_id_ctrl's keys in its order (nvme-cli src/nvme-print-json.c). The ones our IdentifyController
# decodes are printed; bytes it keeps reserved (bpcap, nssl, plsi, crcap, kpioc, ...) are left out.
ID_CTRL_KEYS = (
    "vid", "ssvid", "sn", "mn", "fr", "rab", "ieee", "cmic", "mdts", "cntlid", "ver", "rtd3r", "rtd3e", "oaes",
    "ctratt", "rrls", "bpcap", "nssl", "plsi", "cntrltype", "fguid", "crdt1", "crdt2", "crdt3", "crcap", "nvmsr",
    "vwci", "mec", "oacs", "acl", "aerl", "frmw", "lpa", "elpe", "npss", "avscc", "apsta", "wctemp", "cctemp",
    "mtfa", "hmpre", "hmmin", "tnvmcap", "unvmcap", "rpmbs", "edstt", "dsto", "fwug", "kas", "hctma", "mntmt",
    "mxtmt", "sanicap", "hmminds", "hmmaxd", "nsetidmax", "endgidmax", "anatt", "anacap", "anagrpmax",
    "nanagrpid", "pels", "domainid", "kpioc", "mptfawr", "megcap", "tmpthha", "cqt", "cdpa", "mup", "ipmsr",
    "msmt", "sqes", "cqes", "maxcmd", "nn", "oncs", "fuses", "fna", "vwc", "awun", "awupf", "icsvscc", "nwpc",
    "acwu", "ocfs", "sgls", "mnan", "maxdna", "maxcna", "oaqd", "rhiri", "hirt", "cmmrtd", "nmmrtd", "minmrtg",
    "maxmrtg", "trattr", "mcudmq", "mnsudmq", "mcmr", "nmcmr", "mcdqpc", "subnqn", "ioccsz", "iorcsz", "icdoff",
    "fcatt", "msdbd", "ofcs", "dctype", "ccrl", "psds",
)
# json_nvme_id_ns's keys in its order (npwg..nows only when NSFEAT bit 4 or 5 is set, npdg only with bit 4)
ID_NS_KEYS = (
    "nsze", "ncap", "nuse", "nsfeat", "nlbaf", "flbas", "mc", "dpc", "dps", "nmic", "rescap", "fpi", "dlfeat",
    "nawun", "nawupf", "nacwu", "nabsn", "nabo", "nabspf", "noiob", "nvmcap", "npwg", "npwa", "npdg", "npda",
    "nows", "mssrl", "mcl", "msrc", "kpios", "nulbaf", "kpiodaag", "anagrpid", "nsattr", "nvmsetid", "endgid",
    "nguid", "eui64", "lbafs",
)


def _psd_json(p: Mapping[str, Any]) -> dict[str, int]:
    """One power state descriptor as json_nvme_id_ctrl's "psds" entries (NVME_PSD_FLAGS_MXPS/NOPS, scale = >> 6)."""
    return {
        "max_power": p["mp"], "max_power_scale": p["flags"] & 1, "non-operational_state": (p["flags"] >> 1) & 1,
        "entry_lat": p["enlat"], "exit_lat": p["exlat"], "read_tput": p["rrt"], "read_lat": p["rrl"],
        "write_tput": p["rwt"], "write_lat": p["rwl"], "idle_power": p["idlp"], "idle_scale": p["ips"] >> 6,
        "active_power": p["actp"], "active_power_work": p["apws"] & 7, "active_scale": p["apws"] >> 6,
        "emerg_power_fail_recover_time": p["epfrt"], "emerg_power_fail_recover_scale": p["epfr_fqv_ts"] & 0xF,
        "force_quiesce_vault_time": p["fqvt"], "force_quiesce_vault_scale": p["epfr_fqv_ts"] >> 4,
        "emerg_power_fail_vault_time": p["epfvt"], "emerg_power_fail_vault_scale": p["epfvts"] & 0xF,
    }


def id_ctrl_json(c: Mapping[str, Any]) -> dict[str, object]:
    """A parsed IdentifyController as ``nvme id-ctrl -o json`` prints it."""
    out: dict[str, object] = {}
    for key in ID_CTRL_KEYS:
        if key == "ieee":
            ieee = bytes(c["ieee"])
            out[key] = ieee[2] << 16 | ieee[1] << 8 | ieee[0]
        elif key == "fguid":
            out[key] = str(uuid.UUID(bytes=bytes(c["fguid"])))
        elif key in ("sn", "mn", "fr", "subnqn"):
            text = str(c[key]).rstrip(" \0")
            if text or key != "subnqn":  # nvme-cli omits an empty subnqn
                out[key] = text
        elif key == "psds":
            out[key] = [_psd_json(p) for p in list(c["psd"])[:c["npss"] + 1]]
        elif key in c:
            out[key] = c[key]
    return out


def id_ns_json(ns: Mapping[str, Any]) -> dict[str, object]:
    """A parsed IdentifyNamespace as ``nvme id-ns -o json`` prints it (lbafs as in json_nvme_id_ns_lbaf)."""
    out: dict[str, object] = {}
    in_use = ns["flbas"] & 0xF | ((ns["flbas"] >> 1) & 0x30)  # nvme_id_ns_flbas_to_lbaf_inuse: bits 3:0, 6:5
    for key in ID_NS_KEYS:
        if key in ("npwg", "npwa", "npda", "nows") and not ns["nsfeat"] & 0x30:
            continue
        if key == "npdg" and not ns["nsfeat"] & 0x10:
            continue
        if key in ("nguid", "eui64"):
            out[key] = bytes(ns[key]).hex()
        elif key == "lbafs":
            out[key] = [{"lbaf": i, "ms": f["ms"], "ds": f["lbads"], "rp": f["rp"], "in_use": int(i == in_use)}
                        for i, f in enumerate(list(ns["lbaf"])[:ns["nlbaf"] + 1])]
        elif key in ns:
            out[key] = ns[key]
    return out


# stdout_id_ctrl's leading lines: key, and how nvme-cli formats the value
_ID_CTRL_TEXT = (("vid", "x"), ("ssvid", "x"), ("sn", "s"), ("mn", "s"), ("fr", "s"), ("rab", "d"),
                 ("ieee", "ieee"), ("cmic", "x"), ("mdts", "d"), ("cntlid", "x"), ("ver", "x"), ("oacs", "x"),
                 ("kas", "d"), ("sqes", "x"), ("cqes", "x"), ("maxcmd", "d"), ("nn", "d"), ("oncs", "x"),
                 ("vwc", "x"), ("sgls", "x"), ("subnqn", "s"), ("ioccsz", "d"), ("iorcsz", "d"), ("icdoff", "d"),
                 ("fcatt", "x"), ("msdbd", "d"), ("cntrltype", "d"))


def id_ctrl_text(c: Mapping[str, Any]) -> str:
    """The main fields as ``nvme id-ctrl`` prints them: ``key       : value``, hex where nvme-cli uses %#x."""
    j = id_ctrl_json(c)
    lines = ["NVME Identify Controller:"]
    for key, fmt in _ID_CTRL_TEXT:
        value = j.get(key, "")
        if fmt == "x":
            value = c_hex(value)
        elif fmt == "ieee":
            value = f"{value:06x}"
        lines.append(f"{key:<10}: {value}")
    return "\n".join(lines)


# -- log pages: json_error_log / json_smart_log / json_fw_log -----------------------------------------


def error_log_json(entries: Iterable[Mapping[str, Any]]) -> dict[str, object]:
    """Error log entries as ``nvme error-log -o json``: the CQE status split into status_field and phase_tag."""
    errors = []
    for e in entries:
        errors.append({
            "error_count": e["error_count"], "sqid": e["sqid"], "cmdid": e["cmdid"],
            "status_field": e["status_field"] >> 1, "phase_tag": e["status_field"] & 1,
            "parm_error_location": e["param_error_location"], "lba": e["lba"], "nsid": e["nsid"], "vs": e["vs"],
            "trtype": e["trtype"], "csi": e["csi"], "opcode": e["opcode"], "cs": e["cs"],
            "trtype_spec_info": e["trtype_spec_info"], "log_page_version": e["log_page_version"],
        })
    return {"errors": errors}


# our SmartLog field -> json_smart_log key, in nvme-cli's order
SMART_KEYS = (
    ("critical_warning", "critical_warning"), ("temperature", "temperature"), ("avail_spare", "avail_spare"),
    ("spare_thresh", "spare_thresh"), ("percent_used", "percent_used"),
    ("endu_grp_crit_warn_sumry", "endurance_grp_critical_warning_summary"),
    ("data_units_read", "data_units_read"), ("data_units_written", "data_units_written"),
    ("host_reads", "host_read_commands"), ("host_writes", "host_write_commands"),
    ("ctrl_busy_time", "controller_busy_time"), ("power_cycles", "power_cycles"),
    ("power_on_hours", "power_on_hours"), ("unsafe_shutdowns", "unsafe_shutdowns"),
    ("media_errors", "media_errors"), ("num_err_log_entries", "num_err_log_entries"),
    ("warning_temp_time", "warning_temp_time"), ("critical_comp_time", "critical_comp_time"),
    ("temp_sensor", "temperature_sensor_"), ("thm_temp1_trans_count", "thm_temp1_trans_count"),
    ("thm_temp2_trans_count", "thm_temp2_trans_count"), ("thm_temp1_total_time", "thm_temp1_total_time"),
    ("thm_temp2_total_time", "thm_temp2_total_time"),
)


def smart_log_json(s: Mapping[str, Any]) -> dict[str, object]:
    """A parsed SmartLog as ``nvme smart-log -o json`` (temperatures in Kelvin; zero sensors left out)."""
    out: dict[str, object] = {}
    for ours, key in SMART_KEYS:
        if ours == "temp_sensor":
            out.update({f"{key}{i + 1}": t for i, t in enumerate(s["temp_sensor"]) if t})
        else:
            out[key] = s[ours]
    return out


def fw_log_json(fw: Mapping[str, Any], device: str) -> dict[str, object]:
    """A parsed FirmwareSlotLog as ``nvme fw-log -o json``: keyed by the device (here the subsystem NQN),
    each revision as its 64-bit value and its text."""
    slots: dict[str, object] = {"Active Firmware Slot (afi)": fw["afi"]}
    for i, rev in enumerate(fw["frs"]):
        if rev:
            raw = str(rev).encode("ascii", "replace").ljust(8, b" ")[:8]
            slots[f"Firmware Rev Slot {i + 1}"] = f"{int.from_bytes(raw, 'little')} ({rev})"
    return {device: slots}


# -- features: json_feature_show / stdout_feature_show ------------------------------------------------


def c_hex(value: int, width: int = 0) -> str:
    """C's ``%#0*x``: no 0x prefix on zero, as nvme-cli's output shows it ("00000000", "0")."""
    return f"{value:0{width}x}" if value == 0 else f"{value:#0{width}x}"


def feature_name(fid: int) -> str:
    return FEATURE_NAMES.get(fid, "Unknown")


def feature_json(fid: int, sel: int, value: int) -> dict[str, object]:
    return {f"feature: {c_hex(fid, 4 if fid else 2)}": {
        "name": feature_name(fid), SELECT_NAMES.get(sel, "Reserved"): c_hex(value, 10 if value else 8)}}


def feature_text(fid: int, sel: int, value: int) -> str:
    return (f"get-feature:{c_hex(fid, 4 if fid else 2)} ({feature_name(fid)}), "
            f"{SELECT_NAMES.get(sel, 'Reserved')} value:{c_hex(value, 10 if value else 8)}")


# -- kernel controllers: json_detail_list / stdout_detailed_list (`nvme list -v`) ----------------------


def _namespace_json(n: Mapping[str, Any]) -> dict[str, object]:
    return {"NameSpace": n["name"], "NSID": n["nsid"], "MaximumLBA": n["lbas"], "PhysicalSize": n["size"],
            "SectorSize": n["lba_size"]}


def kernel_list_json(ctrls: Sequence[Mapping[str, Any]]) -> dict[str, object]:
    """Fabrics controllers (initiator.kernel.controllers()) in json_detail_list's shape: hosts, their
    subsystems, each subsystem's controllers with their namespaces. "State" is ours (nvme-cli has none);
    UsedBytes, Generic and Paths are not read."""
    hosts: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for c in ctrls:
        subsystems = hosts.setdefault((c.get("hostnqn", ""), c.get("hostid", "")), {})
        name = c.get("subsystem") or c["name"]
        sub = subsystems.setdefault(name, {"Subsystem": name, "SubsystemNQN": c["subsysnqn"], "Controllers": [],
                                           "Namespaces": []})
        sub["Controllers"].append({
            "Controller": c["name"], "Cntlid": str(c["cntlid"]), "SerialNumber": c.get("serial", ""),
            "ModelNumber": c.get("model", ""), "Firmware": c.get("firmware", ""), "Transport": c["transport"],
            "Address": c["address"], "Slot": "", "State": c["state"],
            "Namespaces": [_namespace_json(n) for n in c.get("namespaces", [])], "Paths": [],
        })
    devices = []
    for (hostnqn, hostid), subsystems in hosts.items():
        entry: dict[str, object] = {"HostNQN": hostnqn}
        if hostid:
            entry["HostID"] = hostid
        entry["Subsystems"] = list(subsystems.values())
        devices.append(entry)
    return {"Devices": devices}


def kernel_list_text(ctrls: Sequence[Mapping[str, Any]], table: Callable[..., str]) -> str:
    """stdout_detailed_list's controller table (Device, Cntlid, SN, MN, FR, TxPort, Address, Subsystem,
    Namespaces), with the controller state added."""
    return table(["Device", "Cntlid", "SN", "MN", "FR", "TxPort", "Address", "State", "Subsystem", "Namespaces"],
                 [[c["name"], c["cntlid"], c.get("serial", ""), c.get("model", ""), c.get("firmware", ""),
                   c["transport"], c["address"], c["state"], c["subsysnqn"],
                   " ".join(c["block_devices"]) or "-"] for c in ctrls])


# -- reservation status: json_nvme_resv_report / stdout_resv_report ------------------------------------


def _hostid_value(hostid: bytes, eds: bool) -> int | str:
    """nvme-cli shows an 8-byte host ID as the little-endian u64 it reads, a 128-bit one as its bytes in hex."""
    return hostid.hex() if eds else int.from_bytes(hostid[:8], "little")


def resv_report_json(report: Any, eds: bool) -> dict[str, object]:
    """gen, rtype, regctl, ptpls, then "regctls" (or "regctlext" with EDS) as json_nvme_resv_report has them."""
    out: dict[str, object] = {"gen": report.gen, "rtype": report.rtype, "regctl": report.regctl,
                              "ptpls": int(report.ptpls)}
    entries = []
    for r in report.registrants:
        rcsts = int(r.holds)
        if eds:
            entries.append({"cntlid": r.cntlid, "rcsts": rcsts, "rkey": r.rkey,
                            "hostid": _hostid_value(r.hostid, True)})
        else:
            entries.append({"cntlid": r.cntlid, "rcsts": rcsts, "hostid": _hostid_value(r.hostid, False),
                            "rkey": r.rkey})
    out["regctlext" if eds else "regctls"] = entries
    return out


def resv_report_text(report: Any, eds: bool) -> str:
    """nvme-cli's "NVME Reservation status:" block: the header fields, then each registrant (hex values).

    An extended host ID is printed as 32 hex digits (nvme-cli's JSON form; its text drops leading zeros
    per byte with %x)."""
    lines = ["", "NVME Reservation status:", "", f"gen       : {report.gen}", f"rtype     : {report.rtype}",
             f"regctl    : {report.regctl}", f"ptpls     : {int(report.ptpls)}"]
    for i, r in enumerate(report.registrants):
        if eds:
            lines += [f"regctlext[{i}] :", f"  cntlid     : {r.cntlid:x}", f"  rcsts      : {int(r.holds):x}",
                      f"  rkey       : {r.rkey:x}", f"  hostid     : {r.hostid.hex()}"]
        else:
            lines += [f"regctl[{i}] :", f"  cntlid  : {r.cntlid:x}", f"  rcsts   : {int(r.holds):x}",
                      f"  hostid  : {_hostid_value(r.hostid, False):x}", f"  rkey    : {r.rkey:x}"]
    return "\n".join(lines) + "\n"
