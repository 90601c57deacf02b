"""nvme-cli-style output of the host-side commands (`-o normal|json`), the name tables, and shell completion.

The host commands run as `python -m nvmeof.cli` subprocesses against `nvmeof serve` (one per module). nvme-cli
cannot be run against our target here (no kernel modules), so its JSON keys are fixed lists below, each taken
from the function of nvme-cli's src/nvme-print-json.c named next to it (linux-nvme/nvme-cli, 2026-08).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from nvmeof import defaults
from nvmeof.cli import cli, render
from nvmeof.spec import fabrics

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.interop.ourtarget import serve_target  # noqa: E402

# json_discovery_log: each record's keys for a TCP entry (sectype is its TCP-only tail)
NVME_CLI_DISCOVERY_RECORD = ["trtype", "adrfam", "subtype", "treq", "portid", "trsvcid", "subnqn", "traddr",
                             "eflags", "sectype"]
# json_print_nvme_id_ctrl (json_nvme_id_ctrl): the keys every controller has, in nvme-cli's order
NVME_CLI_ID_CTRL = ["vid", "ssvid", "sn", "mn", "fr", "rab", "ieee", "cmic", "mdts", "cntlid", "ver", "rtd3r",
                    "rtd3e", "oaes", "ctratt", "rrls", "cntrltype", "fguid", "crdt1", "crdt2", "crdt3", "nvmsr",
                    "vwci", "mec", "oacs", "acl", "aerl", "frmw", "lpa", "elpe", "npss", "avscc", "apsta", "wctemp",
                    "cctemp", "mtfa", "hmpre", "hmmin", "tnvmcap", "unvmcap", "rpmbs", "edstt", "dsto", "fwug",
                    "kas", "hctma", "mntmt", "mxtmt", "sanicap", "hmminds", "hmmaxd", "nsetidmax", "endgidmax",
                    "anatt", "anacap", "anagrpmax", "nanagrpid", "pels", "domainid", "megcap", "tmpthha", "sqes",
                    "cqes", "maxcmd", "nn", "oncs", "fuses", "fna", "vwc", "awun", "awupf", "icsvscc", "nwpc",
                    "acwu", "ocfs", "sgls", "mnan", "maxdna", "maxcna", "oaqd", "cmmrtd", "nmmrtd", "minmrtg",
                    "maxmrtg", "trattr", "mcudmq", "mnsudmq", "mcmr", "nmcmr", "mcdqpc", "subnqn", "ioccsz",
                    "iorcsz", "icdoff", "fcatt", "msdbd", "ofcs", "dctype", "psds"]
# json_nvme_id_ctrl's "psds" entries
NVME_CLI_PSD = ["max_power", "max_power_scale", "non-operational_state", "entry_lat", "exit_lat", "read_tput",
                "read_lat", "write_tput", "write_lat", "idle_power", "idle_scale", "active_power", "active_power_work",
                "active_scale", "emerg_power_fail_recover_time", "emerg_power_fail_recover_scale",
                "force_quiesce_vault_time", "force_quiesce_vault_scale", "emerg_power_fail_vault_time",
                "emerg_power_fail_vault_scale"]
# json_nvme_id_ns with NSFEAT bits 4 and 5 clear (no npwg/npwa/npdg/npda/nows)
NVME_CLI_ID_NS = ["nsze", "ncap", "nuse", "nsfeat", "nlbaf", "flbas", "mc", "dpc", "dps", "nmic", "rescap", "fpi",
                  "dlfeat", "nawun", "nawupf", "nacwu", "nabsn", "nabo", "nabspf", "noiob", "nvmcap", "mssrl", "mcl",
                  "msrc", "kpios", "nulbaf", "kpiodaag", "anagrpid", "nsattr", "nvmsetid", "endgid", "nguid", "eui64",
                  "lbafs"]
# json_nvme_id_ns_lbaf (not verbose)
NVME_CLI_LBAF = ["lbaf", "ms", "ds", "rp", "in_use"]
# json_smart_log (not verbose), zero temperature sensors left out, before op_lifetime_energy_consumed
NVME_CLI_SMART = ["critical_warning", "temperature", "avail_spare", "spare_thresh", "percent_used",
                  "endurance_grp_critical_warning_summary", "data_units_read", "data_units_written",
                  "host_read_commands", "host_write_commands", "controller_busy_time", "power_cycles",
                  "power_on_hours", "unsafe_shutdowns", "media_errors", "num_err_log_entries", "warning_temp_time",
                  "critical_comp_time", "temperature_sensor_1", "thm_temp1_trans_count", "thm_temp2_trans_count",
                  "thm_temp1_total_time", "thm_temp2_total_time"]
# json_error_log: each entry of "errors"
NVME_CLI_ERROR = ["error_count", "sqid", "cmdid", "status_field", "phase_tag", "parm_error_location", "lba", "nsid",
                  "vs", "trtype", "csi", "opcode", "cs", "trtype_spec_info", "log_page_version"]


def nvmeof(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nvmeof.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=_REPO, check=False)


def ok(*args: str) -> str:
    proc = nvmeof(*args)
    assert proc.returncode == 0, (args, proc.stderr)
    return proc.stdout


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    with serve_target(tmp_path_factory.mktemp("serve"), size="16M") as t:
        yield t
        t.assert_no_errors()


def _conn(t) -> list[str]:
    return ["-a", t.traddr, "-s", str(t.io_port), "-n", t.subnqn]


def test_discover_json_has_nvme_clis_keys_and_names(target):
    out = json.loads(ok("discover", "-a", target.traddr, "-s", str(target.discovery_port), "-o", "json"))
    assert list(out) == ["genctr", "records"] and isinstance(out["genctr"], int)
    by_nqn = {r["subnqn"]: r for r in out["records"]}
    for record in out["records"]:
        assert list(record) == NVME_CLI_DISCOVERY_RECORD
    nvm, current = by_nqn[target.subnqn], by_nqn[defaults.DISCOVERY_NQN]
    assert (nvm["trtype"], nvm["adrfam"], nvm["subtype"], nvm["traddr"], nvm["trsvcid"], nvm["sectype"]) == \
        ("tcp", "ipv4", "nvme subsystem", "127.0.0.1", str(target.io_port), "none")
    assert nvm["treq"] == "not specified, sq flow control disable supported"   # our TCP entries offer it
    assert current["subtype"] == "current discovery subsystem" and current["eflags"] == "explicit discovery connections"
    assert isinstance(nvm["portid"], int)
    # the older --json is the same switch
    assert json.loads(ok("discover", "-a", target.traddr, "-s", str(target.discovery_port), "--json")) == out


def test_discover_normal_output_names_values_as_nvme_cli(target):
    text = ok("discover", "-a", target.traddr, "-s", str(target.discovery_port))
    lines = text.splitlines()
    assert lines[1].startswith("Discovery Log Number of Records 2, Generation counter ")
    assert "=====Discovery Log Entry 0======" in lines
    for line in ("trtype:  tcp", "adrfam:  ipv4", "subtype: nvme subsystem", "subtype: current discovery subsystem",
                 "treq:    not specified, sq flow control disable supported", "sectype: none",
                 f"subnqn:  {target.subnqn}", f"trsvcid: {target.io_port}", "eflags:  none"):
        assert line in lines, (line, text)
    assert "trtype:  3" not in text and "subtype: 2" not in text


def test_identify_json_follows_id_ctrl_and_id_ns(target):
    out = json.loads(ok("identify", *_conn(target), "-o", "json"))
    ctrl = out["controller"]
    assert list(ctrl) == NVME_CLI_ID_CTRL
    assert ctrl["subnqn"] == target.subnqn and ctrl["mn"] == defaults.MODEL and ctrl["cntlid"] > 0
    assert isinstance(ctrl["ieee"], int) and len(ctrl["fguid"]) == 36
    assert [list(p) for p in ctrl["psds"]] == [NVME_CLI_PSD] * (ctrl["npss"] + 1)
    [ns] = out["namespaces"]
    assert list(ns) == ["nsid", "block_size", "size", *NVME_CLI_ID_NS]
    assert (ns["nsid"], ns["size"], ns["block_size"], ns["nsze"]) == (1, 16 << 20, 512, (16 << 20) // 512)
    assert [list(f) for f in ns["lbafs"]] == [NVME_CLI_LBAF] * (ns["nlbaf"] + 1)
    assert ns["lbafs"][0]["in_use"] == 1 and ns["lbafs"][0]["ds"] == 9
    assert len(ns["nguid"]) == 32 and len(ns["eui64"]) == 16
    text = ok("identify", *_conn(target))
    assert text.startswith("NVME Identify Controller:\nvid       : ")
    assert f"subnqn    : {target.subnqn}" in text.splitlines()


def test_get_log_json_shapes(target):
    smart = json.loads(ok("get-log", *_conn(target), "-i", "smart", "-o", "json"))
    assert list(smart) == NVME_CLI_SMART
    assert smart["temperature"] > 273 and smart["power_cycles"] >= 1
    errors = json.loads(ok("get-log", *_conn(target), "-i", "error", "-l", "256", "-o", "json"))
    assert list(errors) == ["errors"] and all(list(e) == NVME_CLI_ERROR for e in errors["errors"])
    fw = json.loads(ok("get-log", *_conn(target), "-i", "fw_slot", "-o", "json"))
    assert fw[target.subnqn]["Active Firmware Slot (afi)"] == 1
    assert fw[target.subnqn]["Firmware Rev Slot 1"].endswith(f"({defaults.FIRMWARE_REVISION[:8]})")
    raw = json.loads(ok("get-log", *_conn(target), "-i", "changed_ns", "-l", "16", "-L", "0", "-o", "json"))
    assert raw == {"lid": 4, "lpo": 0, "length": 16, "data": "00" * 16}
    text = ok("get-log", *_conn(target), "-i", "smart")
    assert any(line.split(":")[0].strip() == "host_read_commands" for line in text.splitlines())


def test_get_feature_as_nvme_cli(target):
    out = json.loads(ok("get-feature", *_conn(target), "-f", "num_queues", "-o", "json"))
    [(key, body)] = out.items()
    assert key == "feature: 0x07" and body["name"] == "Number of Queues"
    assert body["Current"].startswith("0x") and len(body["Current"]) == 10
    text = ok("get-feature", *_conn(target), "-f", "kato", "--sel", "1")
    assert text.startswith("get-feature:0x0f (Keep Alive Timer), Default value:")


# -- name tables, no target ---------------------------------------------------------------------------


def test_name_tables_match_libnvme():
    # libnvme src/nvme/fabrics.c trtypes[] / adrfams[] / subtypes[] / treqs[] / eflags_strings[] / sectypes[]
    assert [fabrics.trtype_str(v) for v in (1, 2, 3, 254, 0, 9)] == \
        ["rdma", "fc", "tcp", "loop", "unrecognized", "unrecognized"]
    assert [fabrics.adrfam_str(v) for v in (0, 1, 2, 3, 4, 254)] == \
        ["pci", "ipv4", "ipv6", "infiniband", "fibre-channel", "unrecognized"]
    assert [fabrics.subtype_str(v) for v in (1, 2, 3, 0)] == \
        ["discovery subsystem referral", "nvme subsystem", "current discovery subsystem", "unrecognized"]
    assert [fabrics.treq_str(v) for v in (0, 1, 2, 4, 6, 3)] == [
        "not specified", "required", "not required", "not specified, sq flow control disable supported",
        "not required, sq flow control disable supported", "unrecognized"]
    assert fabrics.eflags_str(0) == "none"
    assert fabrics.eflags_str(3) == "explicit discovery connections, duplicate discovery information"
    assert fabrics.eflags_str(7) == ("explicit discovery connections, duplicate discovery information, "
                                     "no cdc connectivity")
    assert [fabrics.sectype_str(v) for v in (0, 1, 2, 3)] == ["none", "tls", "tls13", "unrecognized"]
    assert [fabrics.prtype_str(v) for v in (1, 2, 3, 4, 5)] == \
        ["not specified", "infiniband", "roce", "roce-v2", "iwarp"]
    assert (fabrics.qptype_str(1), fabrics.cms_str(1)) == ("connected", "rdma-cm")


def test_rdma_discovery_record_and_text():
    from initiator.discovery import DiscoveryEntry

    tsas = fabrics.TsasRdma.build({"qptype": 1, "prtype": 4, "cms": 1, "pkey": 0xFFFF})
    entry = DiscoveryEntry(1, 2, 2, 0, 7, 0xFFFF, 32, 0, "4420", "nqn.2014-08.org.example:a", "fe80::1", tsas)
    record = render.discovery_record(entry)
    assert record["adrfam"] == "ipv6" and record["trtype"] == "rdma" and "sectype" not in record
    assert (record["rdma_prtype"], record["rdma_qptype"], record["rdma_cms"], record["rdma_pkey"]) == \
        ("roce-v2", "connected", "rdma-cm", 0xFFFF)
    text = render.discovery_log_text(5, [entry]).splitlines()
    assert "rdma_pkey: 0xffff" in text and "rdma_cms:    rdma-cm" not in text and "rdma_cms: rdma-cm" in text


def test_c_style_hex():
    # printf("%#0*x"): C prints no 0x prefix for zero, which is why nvme-cli widens 8 to 10 for non-zero values
    assert render.c_hex(0, 8) == "00000000" and render.c_hex(0x1F001F, 10) == "0x001f001f"
    assert render.c_hex(0) == "0" and render.c_hex(0x66) == "0x66"
    assert render.feature_text(6, 0, 0) == "get-feature:0x06 (Volatile Write Cache), Current value:00000000"


# -- `nvmeof list`: kernel controllers ---------------------------------------------------------------


def test_list_prints_nvme_cli_detail_list(monkeypatch, tmp_path):
    from initiator import kernel

    block = tmp_path / "block" / "nvme2n1"
    (block / "queue").mkdir(parents=True)
    (block / "size").write_text("131072\n")            # 512-byte sectors: 64 MiB
    (block / "queue" / "logical_block_size").write_text("4096\n")
    (block / "nsid").write_text("1\n")
    monkeypatch.setattr(kernel, "SYS_BLOCK", tmp_path / "block")
    ns = kernel.namespace_info("/dev/nvme2n1")
    assert ns == {"name": "nvme2n1", "nsid": 1, "lba_size": 4096, "size": 64 << 20, "lbas": 16384}
    ctrl = {"name": "nvme3", "transport": "tcp", "address": "traddr=10.0.0.1,trsvcid=4420", "subsysnqn": "nqn.x:a",
            "state": "live", "cntlid": "5", "block_devices": ["/dev/nvme2n1"], "serial": "SN1", "model": "M",
            "firmware": "0.1.0", "hostnqn": "nqn.h", "hostid": "id1", "subsystem": "nvme-subsys2", "namespaces": [ns]}
    monkeypatch.setattr(kernel, "controllers_detail", lambda: [ctrl])
    res = CliRunner().invoke(cli, ["list", "-o", "json"])
    assert res.exit_code == 0, res.output
    # json_detail_list: Devices -> HostNQN/HostID/Subsystems -> Subsystem/SubsystemNQN/Controllers
    [host] = json.loads(res.output)["Devices"]
    assert list(host) == ["HostNQN", "HostID", "Subsystems"] and host["HostNQN"] == "nqn.h"
    [sub] = host["Subsystems"]
    assert (sub["Subsystem"], sub["SubsystemNQN"]) == ("nvme-subsys2", "nqn.x:a")
    [c] = sub["Controllers"]
    assert {k: c[k] for k in ("Controller", "Cntlid", "SerialNumber", "ModelNumber", "Firmware", "Transport",
                              "Address")} == {"Controller": "nvme3", "Cntlid": "5", "SerialNumber": "SN1",
                                              "ModelNumber": "M", "Firmware": "0.1.0", "Transport": "tcp",
                                              "Address": "traddr=10.0.0.1,trsvcid=4420"}
    assert c["Namespaces"] == [{"NameSpace": "nvme2n1", "NSID": 1, "MaximumLBA": 16384, "PhysicalSize": 64 << 20,
                                "SectorSize": 4096}]
    res = CliRunner().invoke(cli, ["list"])
    assert res.exit_code == 0
    assert res.output.split()[:10] == ["Device", "Cntlid", "SN", "MN", "FR", "TxPort", "Address", "State",
                                       "Subsystem", "Namespaces"]
    assert "nvme2n1" in res.output and "live" in res.output


def test_every_host_command_takes_output_format():
    for name in ("discover", "identify", "get-log", "get-feature", "read", "write", "connect", "disconnect", "list"):
        opts = {o for p in cli.commands[name].params for o in p.opts}
        assert {"-o", "--output-format", "--json"} <= opts, name
    # nvme-cli's spellings for what -o used to mean
    assert "-L" in {o for p in cli.commands["get-log"].params for o in p.opts}
    assert "-d" in {o for p in cli.commands["read"].params for o in p.opts}


# -- shell completion --------------------------------------------------------------------------------


@pytest.mark.parametrize(("shell", "marker"), [("bash", "complete -o nosort -F _nvmeof_completion nvmeof"),
                                               ("zsh", "#compdef nvmeof")])
def test_completion_scripts(shell, marker):
    script = ok("completion", shell)
    assert marker in script and f"_NVMEOF_COMPLETE={shell}_complete" in script


def test_bash_completion_completes_commands_and_choices(tmp_path):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    script = ok("completion", "bash")
    # the script runs `env ... nvmeof`: a stand-in on PATH runs this tree's code, not an installed console script
    stand_in = tmp_path / "nvmeof"
    stand_in.write_text(f'#!/bin/sh\ncd {_REPO} && exec {sys.executable} -m nvmeof.cli "$@"\n')
    stand_in.chmod(0o755)
    driver = f"""
{script}
COMP_WORDS=(nvmeof disc); COMP_CWORD=1; _nvmeof_completion nvmeof; echo "${{COMPREPLY[*]}}"
COMPREPLY=(); COMP_WORDS=(nvmeof discover -o ''); COMP_CWORD=3; _nvmeof_completion nvmeof; echo "${{COMPREPLY[*]}}"
COMPREPLY=(); COMP_WORDS=(nvmeof subsystem list --output-f); COMP_CWORD=3; _nvmeof_completion nvmeof
echo "${{COMPREPLY[*]}}"
"""
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([bash, "-c", driver], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    commands, formats, option = proc.stdout.splitlines()[-3:]
    assert set(commands.split()) == {"discover", "disconnect"}
    assert formats.split() == ["normal", "json"]
    assert option.split() == ["--output-format"]


def test_completion_refuses_other_shells():
    res = CliRunner().invoke(cli, ["completion", "tcsh"])
    assert res.exit_code == 2 and "'tcsh' is not one of 'bash', 'zsh'" in res.output
