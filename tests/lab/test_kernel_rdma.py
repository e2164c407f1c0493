"""`nvmeof-roce rdma status/add-rxe/del-rxe/roce-mode` on the guest's real Soft-RoCE."""
import os

import pytest

from kernel_helpers import LAB_IP, cli, save_capture, sh

pytestmark = pytest.mark.lab


def test_status_reports_rxe0_with_roce_v2_gid():
    st = cli("rdma", "status", "--json")
    save_capture("rdma-status.json", str(st))
    rxe = next(d for d in st["devices"] if d["name"] == "rxe0")
    assert rxe["soft_roce"] is True and rxe["node_type"] == "CA"
    (port,) = rxe["ports"]
    assert (port["state"], port["link_layer"], port["netdev"]) == ("ACTIVE", "Ethernet", "rxenet0")
    assert port["active_mtu"] in (256, 512, 1024, 2048, 4096)
    v2 = [g for g in port["gids"] if g["roce"] == "v2" and g["ip"] == LAB_IP]
    assert v2 and v2[0]["gid"] == f"::ffff:{LAB_IP}" and v2[0]["netdev"] == "rxenet0" and v2[0]["type"] == "RoCE v2"
    human = cli("rdma", "status")
    assert "rxe0" in human.stdout and f"::ffff:{LAB_IP}" in human.stdout


def test_roce_mode_read_and_change():
    before = set(os.listdir("/sys/kernel/config/rdma_cm")) if os.path.isdir("/sys/kernel/config/rdma_cm") else set()
    r = cli("rdma", "roce-mode", "rxe0", "1", "--json")
    assert r == {"device": "rxe0", "port": 1, "mode": "v2", "raw": "RoCE v2"}
    s = cli("rdma", "roce-mode", "rxe0", "1", "v2", "--json")
    assert (s["mode"], s["was"]) == ("v2", "v2")
    # rxe has only RoCE v2 GIDs: the kernel refuses v1, and we say why
    p = cli("rdma", "roce-mode", "rxe0", "1", "v1", ok=False)
    assert "rxe0 port 1 refuses RoCE v1 (EINVAL): its GID table has only RoCE v2 entries" in p.stderr, p.stderr
    assert cli("rdma", "roce-mode", "rxe0", "1", "--json")["mode"] == "v2"
    allm = cli("rdma", "roce-mode", "--json")
    assert {"device": "rxe0", "port": 1, "mode": "v2", "raw": "RoCE v2"} in allm
    # the rdma_cm/rxe0 directory we made to read it is gone again
    assert set(os.listdir("/sys/kernel/config/rdma_cm")) == before
    p = cli("rdma", "roce-mode", "nosuch0", "1", ok=False)
    assert "no RDMA device nosuch0" in p.stderr


def test_add_and_delete_soft_roce_link():
    sh("ip", "link", "add", "kttest0", "type", "dummy")
    try:
        sh("ip", "addr", "add", "10.98.0.1/24", "dev", "kttest0")
        sh("ip", "link", "set", "kttest0", "up")
        r = cli("rdma", "add-rxe", "kttest0", "--name", "rxekt", "--json")
        assert r["active"] and r["device"]["name"] == "rxekt"
        st = cli("rdma", "status", "--json")
        dev = next(d for d in st["devices"] if d["name"] == "rxekt")
        assert any(g["ip"] == "10.98.0.1" and g["roce"] == "v2" for g in dev["ports"][0]["gids"])
        dup = cli("rdma", "add-rxe", "kttest0", "--name", "rxekt", ok=False)
        assert "already exists" in dup.stderr
        assert cli("rdma", "del-rxe", "rxekt", "--json") == {"name": "rxekt", "deleted": True}
        assert "rxekt" not in {d["name"] for d in cli("rdma", "status", "--json")["devices"]}
    finally:
        sh("rdma", "link", "delete", "rxekt", check=False)
        sh("ip", "link", "delete", "kttest0", check=False)
    p = cli("rdma", "add-rxe", "nosuchnet0", ok=False)
    assert "netdev nosuchnet0 does not exist" in p.stderr
    p = cli("rdma", "del-rxe", "rxenope", ok=False)
    assert "no RDMA device rxenope" in p.stderr
