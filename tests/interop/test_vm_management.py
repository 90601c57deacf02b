"""An nvmetcli configuration saved from the Linux kernel target in the guest imports into ours.

Debian bookworm has no nvmetcli package, and the busybox guest has no Python, so nvmetcli itself
cannot run there. The guest instead configures nvmet through configfs and dumps configfs with a
shell rendition of nvmetcli's ``Root().dump()`` (nvmet/nvme.py): every object's attribute groups
hold its *writable* ``<group>_<name>`` files as strings, ``enable`` is an integer where the node
has one, and the same extra keys (nsid, ana_grpid, portid, subsystems, ana_groups, referrals,
name, allowed_hosts, passthru, hosts). ``nvmetcli save`` writes that document with
``json.dumps(sort_keys=True, indent=2)``; only list order may differ (nvmetcli follows
``os.listdir``, the shell follows glob order).

On the host the dump goes through ``target.config.import_nvmetcli``; the result is checked item by
item against what the guest configured, then restored into a real Target (device paths and
addresses swapped for host ones) and read back by the Python initiator: the UUID and NGUID the
kernel target had are what our target reports.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

import initiator
from nvmeof import defaults
from nvmeof.auth import generate_secret
from target.config import import_nvmetcli, validate_config
from target.core import Target
from target.service import TargetService
from tests.interop import vm

pytestmark = pytest.mark.vm

VOL = "nqn.2026-11.io.nvmeof-toolkit:nvmetcli-vol1"
OPEN = "nqn.2026-11.io.nvmeof-toolkit:nvmetcli-open"
HOST = "nqn.2014-08.org.nvmexpress:uuid:5b0c3e2a-7d41-4f6e-9a8b-1c2d3e4f5a6b"
NS1_UUID = "d592cdf3-5d1c-44e0-8412-3fcf7d99df27"
NS1_NGUID = "3b2c1d4e-5f60-4718-8293-a4b5c6d7e8f9"
SERIAL = "4e564d6554434c49"
MODEL = "nvmetcli interop"
BEGIN, END = "@@NVMETCLI-DUMP-BEGIN@@", "@@NVMETCLI-DUMP-END@@"
# On a kernel with NVME_TARGET_AUTH (6.12) the host also gets DH-HMAC-CHAP keys, hash and group in configfs.
HOST_KEY = generate_secret(secret=bytes(range(32)), hmac_id=1, nqn=HOST)
HOST_CTRL_KEY = generate_secret(secret=bytes(range(100, 148)), hmac_id=2, nqn=HOST)
HOST_DHCHAP = {"key": HOST_KEY, "ctrl_key": HOST_CTRL_KEY, "hash": "hmac(sha384)", "dhgroup": "ffdhe3072"}

# A kernel target with what the nvmetcli format carries: a host, a subsystem restricted to it with
# serial/model and two namespaces (one disabled, one with given UUID/NGUID), an open subsystem, an
# I/O port exporting both, a discovery port with a referral (one more, disabled).
CONFIGURE = f"""
set -e
C=/sys/kernel/config/nvmet
modprobe brd rd_nr=2 rd_size=8192
mkdir "$C/hosts/{HOST}"
if [ -f "$C/hosts/{HOST}/dhchap_key" ]; then
    echo "{HOST_KEY}" > "$C/hosts/{HOST}/dhchap_key"
    echo "{HOST_CTRL_KEY}" > "$C/hosts/{HOST}/dhchap_ctrl_key"
    echo "{HOST_DHCHAP['hash']}" > "$C/hosts/{HOST}/dhchap_hash"
    echo "{HOST_DHCHAP['dhgroup']}" > "$C/hosts/{HOST}/dhchap_dhgroup"
fi
S=$C/subsystems/{VOL}
mkdir "$S"
echo 0 > "$S/attr_allow_any_host"
echo {SERIAL} > "$S/attr_serial"
echo "{MODEL}" > "$S/attr_model"
ln -s "$C/hosts/{HOST}" "$S/allowed_hosts/{HOST}"
mkdir "$S/namespaces/1"
echo -n /dev/ram0 > "$S/namespaces/1/device_path"
echo {NS1_UUID} > "$S/namespaces/1/device_uuid"
echo {NS1_NGUID} > "$S/namespaces/1/device_nguid"
echo 1 > "$S/namespaces/1/enable"
mkdir "$S/namespaces/3"
echo -n /dev/ram1 > "$S/namespaces/3/device_path"
O=$C/subsystems/{OPEN}
mkdir "$O"
echo 1 > "$O/attr_allow_any_host"
P=$C/ports/1
mkdir "$P"
echo tcp > "$P/addr_trtype"; echo ipv4 > "$P/addr_adrfam"
echo 10.0.2.15 > "$P/addr_traddr"; echo 4420 > "$P/addr_trsvcid"
ln -s "$S" "$P/subsystems/{VOL}"
ln -s "$O" "$P/subsystems/{OPEN}"
D=$C/ports/2
mkdir "$D"
echo tcp > "$D/addr_trtype"; echo ipv4 > "$D/addr_adrfam"
echo 10.0.2.15 > "$D/addr_traddr"; echo 8009 > "$D/addr_trsvcid"
mkdir "$D/referrals/peer"
echo tcp > "$D/referrals/peer/addr_trtype"; echo ipv4 > "$D/referrals/peer/addr_adrfam"
echo 10.0.2.99 > "$D/referrals/peer/addr_traddr"; echo 8009 > "$D/referrals/peer/addr_trsvcid"
echo 5 > "$D/referrals/peer/addr_portid"
echo 1 > "$D/referrals/peer/enable"
mkdir "$D/referrals/off"
echo tcp > "$D/referrals/off/addr_trtype"; echo ipv4 > "$D/referrals/off/addr_adrfam"
echo 10.0.2.98 > "$D/referrals/off/addr_traddr"; echo 8009 > "$D/referrals/off/addr_trsvcid"
set +e
"""

# nvmetcli's dump(), in busybox sh. Function-local names carry a prefix: sh has no locals.
DUMP = r"""
C=/sys/kernel/config/nvmet
q() { printf '"%s"' "$(printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')"; }
# nvmetcli keeps an attribute when its owner-write bit is set (stat S_IWUSR), whoever runs it
# and reads it with .strip(): the kernel pads attr_serial with spaces
val() { sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$1"; }
writable() { case "$(stat -c %a "$1")" in [2367]??) return 0 ;; esac; return 1; }
group() {
    _g_sep=""
    printf '"%s": {' "$2"
    for _g_f in "$1/$2"_*; do
        [ -f "$_g_f" ] && writable "$_g_f" || continue
        _g_n=${_g_f##*/}
        printf '%s%s: %s' "$_g_sep" "$(q "${_g_n#"$2"_}")" "$(q "$(val "$_g_f")")"
        _g_sep=", "
    done
    printf '}'
}
enable() { if [ -f "$1/enable" ]; then printf ', "enable": %d' "$(cat "$1/enable")"; fi; }
names() {
    _n_sep=""
    printf '['
    for _n_e in "$1"/*; do
        [ -e "$_n_e" ] || [ -L "$_n_e" ] || continue
        printf '%s%s' "$_n_sep" "$(q "${_n_e##*/}")"
        _n_sep=", "
    done
    printf ']'
}
number() { _v=$(cat "$1" 2>/dev/null) || _v=0; printf '%d' "${_v:-0}"; }
nl='
'

printf '{'
group "$C" discovery
printf ',\n"hosts": ['
sep=""
for h in "$C"/hosts/*; do
    [ -d "$h" ] || continue
    printf '%s{' "$sep"; group "$h" dhchap; printf ', "nqn": %s}' "$(q "${h##*/}")"
    sep=",$nl"
done
printf '],\n"ports": ['
sep=""
for p in "$C"/ports/*; do
    [ -d "$p" ] || continue
    printf '%s{' "$sep"; group "$p" addr; printf ', '; group "$p" param
    printf ', "portid": %d, "subsystems": ' "${p##*/}"; names "$p/subsystems"
    printf ',\n "ana_groups": ['
    s2=""
    for a in "$p"/ana_groups/*; do
        [ -d "$a" ] || continue
        printf '%s{' "$s2"; group "$a" ana; printf ', "grpid": %d}' "${a##*/}"
        s2=", "
    done
    printf '],\n "referrals": ['
    s2=""
    for r in "$p"/referrals/*; do
        [ -d "$r" ] || continue
        printf '%s{' "$s2"; group "$r" addr; enable "$r"; printf ', "name": %s}' "$(q "${r##*/}")"
        s2=",$nl  "
    done
    printf ']}'
    sep=",$nl"
done
printf '],\n"subsystems": ['
sep=""
for s in "$C"/subsystems/*; do
    [ -d "$s" ] || continue
    printf '%s{' "$sep"; group "$s" attr
    printf ',\n "nqn": %s, "allowed_hosts": ' "$(q "${s##*/}")"; names "$s/allowed_hosts"
    printf ',\n "namespaces": ['
    s2=""
    for n in "$s"/namespaces/*; do
        [ -d "$n" ] || continue
        printf '%s{' "$s2"; group "$n" device; printf ', '; group "$n" ana; printf ', '; group "$n" resv
        enable "$n"
        printf ', "nsid": %d, "ana_grpid": ' "${n##*/}"; number "$n/ana_grpid"; printf '}'
        s2=",$nl  "
    done
    printf ']'
    if [ -d "$s/passthru" ]; then
        # nvmetcli's Passthru node never reads its enable file, so the dump has no "enable"
        printf ',\n "passthru": [{'; group "$s/passthru" device
        for k in clear_ids admin_timeout io_timeout; do
            printf ', "%s": ' "$k"; number "$s/passthru/$k"
        done
        printf '}]'
    fi
    printf '}'
    sep=",$nl"
done
printf ']}\n'
"""

SCRIPT = CONFIGURE + f"""
dmesg -n 1  # keep kernel messages off the console while the dump is printed
echo "{BEGIN}"
(
{DUMP}
) || {{ echo "dump failed"; exit 2; }}
echo "{END}"
"""


def _dump_from_guest(vm_assets: vm.Assets) -> dict:
    result = vm.run_guest(SCRIPT, assets=vm_assets, timeout=120)
    assert result.exit_code == 0, result.output
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), result.script_output, re.S)
    assert match, result.output
    try:
        return json.loads(match.group(1))
    except json.JSONDecodeError as exc:
        raise AssertionError(f"the guest's dump is not JSON ({exc}):\n{match.group(1)}") from None


def _check_nvmetcli_shape(dump: dict, auth: bool) -> None:
    """The document has the keys and value types `nvmetcli save` writes (nvmet/nvme.py dump())."""
    assert set(dump) == {"discovery", "hosts", "ports", "subsystems"}
    # discovery_nqn (the root's one attribute) arrived after 6.1: Debian's 6.1 dumps an empty group
    assert dump["discovery"] in ({}, {"nqn": defaults.DISCOVERY_NQN})
    # Debian's 6.1 has no in-band authentication: an empty dhchap group; 6.12 shows what the guest set
    assert dump["hosts"] == [{"dhchap": HOST_DHCHAP if auth else {}, "nqn": HOST}]
    for port in dump["ports"]:
        assert set(port) == {"addr", "param", "portid", "subsystems", "ana_groups", "referrals"}
        assert {"trtype", "adrfam", "traddr", "trsvcid", "treq"} <= set(port["addr"])
        assert all(isinstance(v, str) for v in port["addr"].values())
        assert isinstance(port["portid"], int)
        assert port["ana_groups"] == [{"ana": {"state": "optimized"}, "grpid": 1}]
        for ref in port["referrals"]:
            assert set(ref) == {"addr", "enable", "name"} and isinstance(ref["enable"], int)
            assert "portid" in ref["addr"]
    for sub in dump["subsystems"]:
        assert {"attr", "nqn", "namespaces", "allowed_hosts"} <= set(sub) <= {*sub, "passthru"}
        assert {"allow_any_host", "serial", "model", "version", "cntlid_min", "cntlid_max"} <= set(sub["attr"])
        for ns in sub["namespaces"]:
            assert set(ns) == {"device", "ana", "resv", "enable", "nsid", "ana_grpid"}
            assert set(ns["device"]) >= {"path", "uuid", "nguid"}
            assert ns["ana"] == {"grpid": "1"} and ns["ana_grpid"] == 1
        for pt in sub.get("passthru", []):
            assert set(pt) == {"device", "clear_ids", "admin_timeout", "io_timeout"}


async def test_kernel_nvmetcli_dump_imports_into_ours(vm_assets: vm.Assets, tmp_path: Path) -> None:
    dump = _dump_from_guest(vm_assets)
    saved = tmp_path / "nvmetcli.json"  # as `nvmetcli save` formats it, for a look after a failure
    saved.write_text(json.dumps(dump, sort_keys=True, indent=2) + "\n")
    auth = vm_assets.has_inband_auth
    _check_nvmetcli_shape(dump, auth)

    out = import_nvmetcli(dump)
    validate_config(dict(out))
    subs = {s["nqn"]: s for s in out["subsystems"]}
    assert set(subs) == {VOL, OPEN}
    vol = subs[VOL]
    # the kernel's keys, hash and group come over under the names nvmetcli and configfs use
    host_entry = {"nqn": HOST, "dhchap_key": HOST_KEY, "dhchap_ctrl_key": HOST_CTRL_KEY,
                  "dhchap_hash": ["hmac(sha384)"], "dhchap_dhgroup": ["ffdhe3072"]} if auth else HOST
    assert vol["allow_any_host"] is False and vol["hosts"] == [host_entry]
    assert vol["serial"] == SERIAL and vol["model"] == MODEL
    ns3 = {"nsid": 3, "backend": "file", "path": "/dev/ram1", "block_size": 512, "enabled": False}
    # nvmet generates a UUID for a namespace given none; the NGUID it leaves at zero ("not set")
    ns3_device = _device(dump, 3)
    assert uuid.UUID(ns3_device["nguid"]).int == 0
    if uuid.UUID(ns3_device["uuid"]).int:
        ns3["uuid"] = ns3_device["uuid"]
    assert vol["namespaces"] == [
        {"nsid": 1, "backend": "file", "path": "/dev/ram0", "block_size": 512, "enabled": True,
         "uuid": NS1_UUID, "nguid": NS1_NGUID.replace("-", "")},
        ns3,
    ]
    assert subs[OPEN]["allow_any_host"] is True and subs[OPEN]["hosts"] == [] and subs[OPEN]["namespaces"] == []
    # Port 1's param_inline_data_size is the kernel's own: nvmet_tcp_add_port sets NVMET_TCP_DEF_INLINE_DATA_SIZE
    # (4 x PAGE_SIZE) when a subsystem link enables the port, and the listener keeps what the kernel served. Port 2
    # was never enabled (no subsystem linked), so it still says -1: the transport's default, ours.
    assert sorted(out["listeners"], key=lambda x: x["portid"]) == [
        {"trtype": "tcp", "adrfam": "ipv4", "traddr": "10.0.2.15", "trsvcid": 4420, "portid": 1, "discovery": False,
         "inline_data_size": 16384},
        {"trtype": "tcp", "adrfam": "ipv4", "traddr": "10.0.2.15", "trsvcid": 8009, "portid": 2, "discovery": True},
    ]
    assert out["referrals"] == [{"trtype": "tcp", "adrfam": "ipv4", "traddr": "10.0.2.99", "trsvcid": 8009,
                                 "subnqn": defaults.DISCOVERY_NQN, "portid": 5}]
    warnings = "\n".join(out.warnings)
    assert "disabled referral, skipped" in warnings
    assert "passthru" not in warnings  # an unused passthru node is no passthru controller
    assert "exported only" not in warnings  # port 1 exports every subsystem

    # Restored into a real target (host files for the guest's RAM disks, a local port), the
    # identifiers the kernel target had are the ones our target reports.
    for sub in out["subsystems"]:
        for ns in sub["namespaces"]:
            disk = tmp_path / Path(ns["path"]).name
            disk.write_bytes(bytes(8 << 20))
            ns["path"] = str(disk)
    [port] = vm.free_ports(1)
    out["listeners"] = [{"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": port, "portid": 1}]
    target = Target()
    service = TargetService(target, config_path=tmp_path / "config.json", backing_dirs=[tmp_path])
    try:
        assert await service.restore(dict(out), persist=True) == []
        assert service.get_subsystem(VOL).hosts == {HOST}
        assert service.get_subsystem(VOL).active_nsids() == [1]
        keys = {"dhchap_secret": HOST_KEY, "dhchap_ctrl_secret": HOST_CTRL_KEY} if auth else {}
        if auth:
            # the imported key is enforced: without it the host gets nowhere
            with pytest.raises(initiator.NvmeError, match="dhchap_secret"):
                await initiator.connect("127.0.0.1", port, VOL, hostnqn=HOST, timeout=10)
        async with initiator.connect("127.0.0.1", port, VOL, hostnqn=HOST, timeout=10, **keys) as ctrl:
            assert ctrl.authenticated is auth
            assert await ctrl.namespaces() == [1]
            ident = await ctrl.identify_namespace(1)
            assert ident.nsze == (8 << 20) // 512
            assert bytes(ident.nguid) == uuid.UUID(NS1_NGUID).bytes
            descriptors = await ctrl.namespace_descriptors(1)
            assert descriptors["uuid"] == uuid.UUID(NS1_UUID).bytes
        with pytest.raises(initiator.NvmeError, match="not allowed"):
            await initiator.connect("127.0.0.1", port, VOL, hostnqn=HOST.replace("5b0c", "0000"), timeout=10)
    finally:
        await target.close()


def _device(dump: dict, nsid: int) -> dict:
    sub = next(s for s in dump["subsystems"] if s["nqn"] == VOL)
    return next(n for n in sub["namespaces"] if n["nsid"] == nsid)["device"]
