"""`fabric plan`: the two headroom formulas against hand-computed values, ECN/DCQCN, the commands,
saving and loading, and the CLI."""
import json

import pytest

from nvmeof_roce.cli import main
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.fabric.apply import host_commands, switch_settings
from nvmeof_roce.fabric.plan import (LinkInputs, load_plan, make_plan, mlx5_headroom, parse_length, parse_speed,
                                     save_plan, sonic_headroom)

LINK_100G = LinkInputs(speed_mbps=100000, cable_m=100, mtu=9216, peer_mtu=9216)
LINK_25G = LinkInputs(speed_mbps=25000, cable_m=3, mtu=1500, peer_mtu=1500)


def test_mlx5_100g_100m_9216_by_hand():
    # (301 + 216 * 100 / 100) * 100000 / 1000 + 272 * 9216 / 100
    #   = 517 * 100 + 2506752 / 100 = 51700 + 25067 = 76767 bytes
    h = mlx5_headroom(LINK_100G)
    assert h.headroom == 76767
    assert {t.name: t.value for t in h.terms} == {"fixed delays": 30100, "cable": 21600, "frames": 25067}
    # the smallest lossless buffer the driver takes: xoff + max_mtu (>= 9216) + one 128 B cell
    assert h.buffer == 76767 + 9216 + 128 == 86111
    assert (h.xoff, h.xon) == (86111 - 76767, 86111 - 76767 - 9216) == (9344, 128)


def test_sonic_100g_100m_9216_by_hand():
    # Spectrum-2: cell 144 > 2 x 64, so worst case factor 144 / 64 = 2.25; 100 % small packets: occupancy 2.25
    # cable: 2 * 100 * 100000 * 1e9 / 198e6 / 8192 = 12330.33; peer response: 394 quanta * 512 / 8 = 25216
    # propagation: 9216 + 12330.33 + 0.8 * 1024 + 25216 = 47581.53
    # xoff: 1024 + 47581.53 * 2.25 = 108082.4 -> 106 KiB = 108544; xon: 18 KiB = 18432; size 126976
    h = sonic_headroom(LINK_100G)
    terms = {t.name: t.value for t in h.terms}
    assert terms["cable"] == pytest.approx(12330.33, abs=0.01)
    assert terms["peer response"] == 25216 and terms["MAC/PHY delay"] == pytest.approx(819.2)
    assert terms["cell occupancy"] == 2.25
    assert (h.xoff, h.xon, h.headroom) == (108544, 18432, 126976)


def test_the_100g_case_lands_in_the_published_range():
    plan = make_plan(LINK_100G)
    low, high = plan["headroom"]["low"], plan["headroom"]["high"]
    assert (low, high) == (76767, 126976)
    assert 72_000 <= low < high <= 127_000


def test_25g_3m_1500_by_hand():
    # mlx5: speed counts as 40G: (301 + 216 * 3 / 100 = 6) * 40 + 272 * 1500 / 100 = 12280 + 4080 = 16360
    nic = mlx5_headroom(LINK_25G)
    assert nic.headroom == 16360
    assert any("below 40 Gb/s" in n for n in nic.notes)
    # SONiC: 80 quanta at 25G -> 5120 B; cable 2 * 3 * 25000 * 1e9 / 198e6 / 8192 = 92.48
    # xoff = 1024 + (1500 + 92.48 + 819.2 + 5120) * 2.25 = 17970.3 -> 18 KiB = 18432; size 18432 + 18432
    sw = sonic_headroom(LINK_25G)
    assert {t.name: t.value for t in sw.terms}["cable"] == pytest.approx(92.48, abs=0.01)
    assert (sw.xoff, sw.xon, sw.headroom) == (18432, 18432, 36864)


def test_sonic_spectrum1_cell_and_a_speed_without_pause_quanta():
    # Spectrum: cell 96 <= 128: factor 2 * 96 / 97; 5G is not in the quanta table: peer response 3.8 KiB
    link = LinkInputs(speed_mbps=5000, cable_m=5, mtu=1500, peer_mtu=1500, asic="spectrum")
    h = sonic_headroom(link)
    terms = {t.name: t.value for t in h.terms}
    assert terms["cell occupancy"] == pytest.approx(192 / 97)
    assert terms["peer response"] == pytest.approx(3.8 * 1024)
    assert any("not in the pause-quanta table" in n for n in h.notes)


def test_mlx5_notes_and_a_too_small_nic_buffer():
    long = mlx5_headroom(LinkInputs(speed_mbps=100000, cable_m=1500, mtu=9216, peer_mtu=9216))
    assert any("1000 m or more" in n for n in long.notes)
    mismatched = mlx5_headroom(LinkInputs(speed_mbps=100000, cable_m=2.5, mtu=4200, peer_mtu=9216))
    assert any("counted as 3 m" in n for n in mismatched.notes)
    assert any("switch port's MTU (9216) is above this port's (4200)" in n for n in mismatched.notes)
    with pytest.raises(NvmeofError, match="needs at least xoff \\+ max_mtu \\+ cell = 86111"):
        mlx5_headroom(LinkInputs(speed_mbps=100000, cable_m=100, mtu=9216, peer_mtu=9216, nic_buffer=80000))
    big = mlx5_headroom(LinkInputs(speed_mbps=100000, cable_m=100, mtu=9216, peer_mtu=9216, nic_buffer=262144))
    assert (big.xoff, big.xon) == (262144 - 76767, 262144 - 76767 - 9216)


def test_ecn_scales_the_paper_thresholds_with_speed():
    ecn = make_plan(LINK_100G)["ecn"]
    assert (ecn["kmin"], ecn["kmax"], ecn["pmax"]) == (12500, 500000, 0.01)
    assert (ecn["paper_kmin"], ecn["paper_kmax"]) == (5000, 200000)


def test_dcqcn_knobs_keep_nic_defaults_unless_asked():
    kept = make_plan(LINK_100G)
    assert kept["host"]["dcqcn"] == {}
    paper = make_plan(LinkInputs(speed_mbps=100000, cable_m=100, mtu=9216, peer_mtu=9216, dcqcn="paper"))
    assert paper["host"]["dcqcn"] == {"rpg_time_reset": 55, "rpg_threshold": 5, "rpg_ai_rate": 40,
                                      "rpg_hai_rate": 400, "min_time_between_cnps": 50}
    p = paper["dcqcn"]["paper"]
    assert (p["g"], p["cnp_interval_us"], p["rate_timer_us"], p["byte_counter"], p["fast_recovery_steps"],
            p["rai_mbps"]) == (1 / 256, 50, 55, 10_000_000, 5, 40)


def test_host_commands_apply_every_setting():
    plan = make_plan(LinkInputs(speed_mbps=100000, cable_m=100, mtu=9216, peer_mtu=9216, dcqcn="paper"))
    lines = [c.line for c in host_commands(plan, netdev="ens1f0np0", rdma_dev="mlx5_0", pci="0000:3b:00.0")]
    assert "ip link set dev ens1f0np0 mtu 9216" in lines
    assert "dcb pfc set dev ens1f0np0 prio-pfc all:off 3:on" in lines
    assert "dcb pfc set dev ens1f0np0 delay 100" in lines
    assert "dcb app add dev ens1f0np0 dscp-prio 26:3" in lines and "dcb app add dev ens1f0np0 dscp-prio 48:6" in lines
    assert ("mkdir -p /sys/kernel/config/rdma_cm/mlx5_0 && echo 106 > "
            "/sys/kernel/config/rdma_cm/mlx5_0/ports/1/default_roce_tos") in lines
    assert "echo 1 > /sys/class/net/ens1f0np0/ecn/roce_np/enable/3" in lines
    assert "echo 1 > /sys/class/net/ens1f0np0/ecn/roce_rp/enable/3" in lines
    assert "echo 55 > /sys/class/net/ens1f0np0/ecn/roce_rp/rpg_time_reset" in lines
    assert "echo 50 > /sys/class/net/ens1f0np0/ecn/roce_np/min_time_between_cnps" in lines
    assert "echo 55 > /sys/kernel/debug/mlx5/0000:3b:00.0/cc_params/rp_time_reset" in lines
    assert "mlnx_qos -i ens1f0np0 --trust dscp --pfc 0,0,0,1,0,0,0,0 --cable_len 100" in lines
    switch = [c.line for c in switch_settings(plan, "Ethernet0")]
    assert "config interface cable-length Ethernet0 100m" in switch
    assert "config ecn -profile AZURE_LOSSLESS -gmin 12500 -gmax 500000 -gdrop 1" in switch


@pytest.mark.parametrize("text,mbps", [("100G", 100000), ("25g", 25000), ("100Gb/s", 100000), ("400GbE", 400000),
                                       ("100", 100000), ("10000", 10000)])
def test_parse_speed(text, mbps):
    assert parse_speed(text) == mbps


@pytest.mark.parametrize("text,metres", [("100m", 100), ("3", 3), ("2.5m", 2.5), ("1km", 1000)])
def test_parse_length(text, metres):
    assert parse_length(text) == metres


@pytest.mark.parametrize("args,message", [
    (["--speed", "fast"], "--speed 'fast': not a link speed"),
    (["--cable", "100 ft"], "--cable '100 ft': not a length"),
    (["--cable", "0m"], "out of range"),
    (["--mtu", "100"], "--mtu 100: not an Ethernet MTU"),
    (["--priority", "9"], "--priority 9: not an 802.1p priority"),
    (["--dscp", "48"], "that is the DSCP of CNPs"),
])
def test_bad_input_names_the_option(capsys, args, message):
    assert main(["fabric", "plan", *args]) == 1
    assert message in capsys.readouterr().err


def test_cli_json_and_save(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["fabric", "plan", "--speed", "100G", "--cable", "100m", "--mtu", "9216", "--json",
                 "--save", str(path), "--netdev", "eth2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["headroom"]["mlx5"]["headroom"] == 76767 and out["headroom"]["sonic"]["headroom"] == 126976
    assert [t["name"] for t in out["headroom"]["mlx5"]["terms"]] == ["fixed delays", "cable", "frames"]
    assert "dcb pfc set dev eth2 prio-pfc all:off 3:on" in [c["command"] for c in out["commands"]["host"]]
    saved = load_plan(str(path))
    assert saved["host"] == out["host"]
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left behind


def test_cli_text_shows_both_formulas_and_the_commands(capsys):
    assert main(["fabric", "plan", "--speed", "100G", "--cable", "100m", "--mtu", "9216"]) == 0
    out = capsys.readouterr().out
    assert "76,767 B (75.0 KiB)" in out and "126,976 B (124.0 KiB)" in out
    assert "range of the two formulas: 76.8 .. 127.0 KB" in out
    assert "floor(216 x 100 m / 100) x 100 Gb/s" in out and "394 pause quanta x 512 bit / 8" in out
    assert "dcb pfc set dev $NETDEV delay 100" in out


def test_load_plan_rejects_what_is_not_a_plan(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(NvmeofError, match="cannot read the plan"):
        load_plan(str(missing))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(NvmeofError, match="is not JSON"):
        load_plan(str(garbage))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hosts": []}))
    with pytest.raises(NvmeofError, match="is not a fabric plan"):
        load_plan(str(other))
    plan = make_plan(LINK_100G)
    del plan["host"]["mtu"]
    broken = tmp_path / "broken.json"
    save_plan(plan, str(broken))
    with pytest.raises(NvmeofError, match="host.mtu is missing"):
        load_plan(str(broken))
