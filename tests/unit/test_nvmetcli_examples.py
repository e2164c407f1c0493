"""nvmetcli's upstream examples (tests/unit/fixtures/nvmetcli-examples/, README there) through `target check` and
`nvmet apply --dry-run`: host names are any configfs name, as nvmetcli and the kernel take them; the RDMA one is
served, loop and fc are refused by the userspace target with the reason; the kernel's offline check takes all."""
import json
from pathlib import Path

import pytest

from nvmeof_roce import cli
from nvmeof_roce.config import load_config, load_userspace_config

EXAMPLES = Path(__file__).parent / "fixtures" / "nvmetcli-examples"
NAMES = ("rdma", "loop", "fc")


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def relocated(name: str, tmp_path: Path) -> Path:
    """The example with its /dev/nvme0n1 replaced by a file here (this machine has no such SSD).  nvmetcli's TCP
    example is outside examples/ (its top-level tcp.json): "tcp" is rdma.json with a tcp port."""
    data = json.loads((EXAMPLES / f"{'rdma' if name == 'tcp' else name}.json").read_text())
    if name == "tcp":
        data["ports"][0]["addr"]["trtype"] = "tcp"
    img = tmp_path / "nvme0n1.img"
    with open(img, "wb") as f:
        f.truncate(1 << 20)
    for s in data["subsystems"]:
        for ns in s["namespaces"]:
            ns["device"]["path"] = str(img)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_the_examples_are_upstreams():
    assert sorted(p.stem for p in EXAMPLES.glob("*.json")) == sorted(NAMES)
    assert "linux-nvme/nvmetcli" in (EXAMPLES / "README.md").read_text()


@pytest.mark.parametrize("name", NAMES)
def test_host_names_are_configfs_names(name):
    cfg = load_config(EXAMPLES / f"{name}.json")
    assert cfg.hosts == ["hostnqn"] and cfg.subsystems[0].nqn == "testnqn"
    if name == "loop":
        assert cfg.subsystems[0].allowed_hosts == ["hostnqn"] and not cfg.subsystems[0].allow_any_host


def test_a_host_name_configfs_cannot_take_is_still_refused(tmp_path):
    from nvmeof_roce.config import ConfigError
    for bad in ("host/1", "", "two words"):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"hosts": [{"nqn": bad}], "subsystems": [], "ports": []}))
        with pytest.raises(ConfigError, match=r"hosts\[0\]\.nqn"):
            load_config(path)
    path.write_text(json.dumps({"hosts": [{"nqn": "nqn.2014-08.org.nvmexpress:uuid:not-a-uuid"}]}))
    with pytest.raises(ConfigError, match="uuid"):
        load_config(path)  # a name that starts as an NQN is checked as one: a typo there is caught


def test_target_check_serves_the_rdma_example_once_its_device_exists(tmp_path, capsys):
    code, out, err = run(capsys, "target", "check", relocated("rdma", tmp_path))
    assert code == 0 and "OK" in out, err
    cfg = load_userspace_config(relocated("rdma", tmp_path))
    assert cfg.ports[0].traddr == "192.168.6.68"


def test_target_check_of_the_rdma_example_as_shipped_names_only_the_missing_device(capsys):
    code, out, _ = run(capsys, "target", "check", "--json", EXAMPLES / "rdma.json")
    result = json.loads(out)
    assert code == 1
    assert [e["field"] for e in result["errors"]] == ["subsystems[0].namespaces[0].device.path"]
    assert "/dev/nvme0n1: no such device" in result["errors"][0]["error"]


@pytest.mark.parametrize("name,trtype", [("loop", "loop"), ("fc", "fc"), ("tcp", "tcp")])
def test_target_check_refuses_loop_fc_and_tcp_ports_with_the_reason(name, trtype, tmp_path, capsys):
    code, out, _ = run(capsys, "target", "check", "--json", relocated(name, tmp_path))
    result = json.loads(out)
    assert code == 1
    assert [e["field"] for e in result["errors"]] == ["ports[0].addr.trtype"]
    assert f"{trtype!r}: the userspace target serves RDMA" in result["errors"][0]["error"]
    assert "nvmet apply" in result["errors"][0]["fix"]


@pytest.mark.parametrize("name", NAMES)
def test_nvmet_apply_dry_run_is_the_offline_check_of_a_kernel_config(name, tmp_path, capsys):
    offline = tmp_path / "no-configfs" / "nvmet"  # no configfs here: planned against an empty kernel target
    code, out, err = run(capsys, "nvmet", "--root", offline, "apply", "--dry-run", "--json", EXAMPLES / f"{name}.json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["dry_run"] and plan["offline"]
    assert any(s["description"] == "+ create subsystem testnqn" for s in plan["steps"]), plan["steps"]
    # the kernel takes the file; enabling the namespace needs the device on the machine that applies it
    assert any("/dev/nvme0n1" in w for w in plan["warnings"]), plan["warnings"]
    assert not offline.exists()
