"""`nvmeof-roce shell` driven by a script builds the same kernel tree as `nvmet apply` of the equivalent file."""
import json

import pytest

from kernel_helpers import HOSTNQN, LAB_IP, cli, modprobe, sparse_file

pytestmark = pytest.mark.lab

SUB = "nqn.2024-01.io.nvmeof-roce:ks"
PORT = 121


def mine(dump):
    return {"subsystems": [s for s in dump["subsystems"] if s["nqn"] == SUB],
            "ports": [p for p in dump["ports"] if p["portid"] == PORT],
            "hosts": [h for h in dump["hosts"] if h["nqn"] == HOSTNQN]}


def test_shell_script_builds_same_tree_as_apply(tmp_path):
    modprobe("nvmet", "nvmet_rdma")
    img = sparse_file("/tmp/nvmeof-ks.img", 16)
    uuid = "6a1d3e1c-2f54-4e0e-9b8e-0c1d2e3f4a5b"
    script = tmp_path / "build.txt"
    script.write_text(f"""
cd /hosts
create {HOSTNQN}
cd /subsystems
create {SUB}
cd {SUB}
set attr allow_any_host=0 serial=ks-serial model=nvmeof-roce
allowed_hosts/ create {HOSTNQN}
namespaces/ create 1
cd namespaces/1
set device path={img} uuid={uuid}
set ns buffered_io=1
enable
/ports create {PORT}
cd /ports/{PORT}
set addr trtype=rdma adrfam=ipv4 traddr={LAB_IP} trsvcid=4422
subsystems/ create {SUB}
""")
    cfg = {"hosts": [{"nqn": HOSTNQN}],
           "ports": [{"portid": PORT, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP,
                                               "trsvcid": "4422"}, "subsystems": [SUB]}],
           "subsystems": [{"nqn": SUB, "attr": {"allow_any_host": "0", "serial": "ks-serial", "model": "nvmeof-roce"},
                           "allowed_hosts": [HOSTNQN],
                           "namespaces": [{"nsid": 1, "buffered_io": 1, "device": {"path": img, "uuid": uuid}}]}]}
    cfile = tmp_path / "ks.json"
    cfile.write_text(json.dumps(cfg))
    from nvmeof_roce.kernel import apply as applymod
    from nvmeof_roce.kernel.nvmet import Root
    from nvmeof_roce.config import parse_config
    try:
        cli("shell", "-f", script)
        by_shell = mine(cli("nvmet", "show", "--json"))
        assert by_shell["subsystems"] and by_shell["ports"][0]["subsystems"] == [SUB]
        ls = cli("shell", "ls", "/")
        assert SUB in ls.stdout and "trtype=rdma" in ls.stdout and "enabled" in ls.stdout
        err = cli("shell", "-c", f"cd /ports/{PORT}; set addr trsvcid=4499", ok=False)
        assert "while subsystems are linked" in err.stderr
        applymod.remove(Root(), parse_config(cfg, "ks.json"))
        assert mine(cli("nvmet", "show", "--json"))["subsystems"] == []
        cli("nvmet", "apply", "--no-prune", cfile)
        by_apply = mine(cli("nvmet", "show", "--json"))
        # the namespace's device_nguid etc. are the kernel's defaults in both: the trees are identical
        assert by_shell == by_apply
    finally:
        applymod.remove(Root(), parse_config(cfg, "ks.json"))
