"""`nvmeof-roce shell` over a fake nvmet configfs: a script builds the same tree as `nvmet apply`."""
import json

import pytest

from nvmeof_roce import cli
from nvmeof_roce.kernel import apply as applymod
from nvmeof_roce.kernel.nvmet import Root
from nvmeof_roce.shell import commands as shellcmd
from nvmeof_roce.shell.commands import run_commands, split_commands
from nvmeof_roce.config import parse_config
from fake_nvmet import FakeNvmetFS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H1 = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001"
S1 = "nqn.2024-01.io.example:one"


@pytest.fixture
def env(tmp_path):
    (tmp_path / "a.img").write_bytes(b"")
    fs = FakeNvmetFS(tmp_path / "cfs")
    return fs, Root(fs.root, fs=fs, sys_module=fs.sys_module), tmp_path


def script(img):
    return f"""
# hosts first: the allow-list links to them
cd /hosts
create {H1}
cd /subsystems
create {S1}
cd {S1}
set attr allow_any_host=0 serial=0123456789abcdef model=nvmeof-roce
allowed_hosts/ create {H1}
namespaces/ create 1
cd namespaces/1
set device path={img} uuid=3d0c3f4e-5b8a-4a57-9a7e-1f2a3b4c5d6e
set ns buffered_io=1
enable
/ports create 1
cd /ports/1
set addr trtype=rdma adrfam=ipv4 traddr=10.99.0.1 trsvcid=4420
subsystems/ create {S1}
"""


def test_split_commands():
    assert split_commands("cd /a; ls\n# c\n\n  create x ;") == ["cd /a", "ls", "create x"]


def test_script_builds_same_tree_as_apply(env, tmp_path):
    fs, root, d = env
    assert run_commands(root, split_commands(script(d / "a.img"))) == 0
    built = root.dump()
    # the same tree from a config file, on a second fake kernel
    fs2 = FakeNvmetFS(tmp_path / "cfs2")
    root2 = Root(fs2.root, fs=fs2, sys_module=fs2.sys_module)
    cfg = {"hosts": [{"nqn": H1}],
           "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                            "trsvcid": "4420"}, "subsystems": [S1]}],
           "subsystems": [{"nqn": S1, "attr": {"allow_any_host": "0", "serial": "0123456789abcdef",
                                               "model": "nvmeof-roce"}, "allowed_hosts": [H1],
                           "namespaces": [{"nsid": 1, "buffered_io": 1,
                                           "device": {"path": str(d / "a.img"),
                                                      "uuid": "3d0c3f4e-5b8a-4a57-9a7e-1f2a3b4c5d6e"}}]}]}
    applymod.apply(root2, parse_config(cfg, "c.json"))
    assert built == root2.dump()


def test_ls_shows_coloured_summary_tree(env, capsys):
    fs, root, d = env
    run_commands(root, split_commands(script(d / "a.img")))
    capsys.readouterr()
    assert run_commands(root, ["ls /"]) == 0
    out = capsys.readouterr().out
    assert "o- subsystems" in out and f"o- {S1}" in out and "allow_any=0" in out
    assert "enabled]" in out and "trtype=rdma, traddr=10.99.0.1, trsvcid=4420" in out
    assert "1 ports, 1 enabled" in out


def test_error_stops_with_kernel_message(env, capsys):
    fs, root, d = env
    run_commands(root, split_commands(script(d / "a.img")))
    capsys.readouterr()
    assert run_commands(root, ["cd /ports/1", "set addr trsvcid=4421", "ls"]) == 1
    err = capsys.readouterr().err
    assert "while subsystems are linked to port 1 (EACCES)" in err and "fix: unlink" in err
    assert run_commands(root, ["/subsystems create testnqn"]) == 1
    assert "'testnqn' is not an NQN" in capsys.readouterr().err
    assert run_commands(root, ["cd /nope"]) == 1
    assert "No such path /nope" in capsys.readouterr().err


def test_get_and_delete(env, capsys):
    fs, root, d = env
    run_commands(root, split_commands(script(d / "a.img")))
    capsys.readouterr()
    assert run_commands(root, [f"/subsystems/{S1}/namespaces/1 get device path"]) == 0
    assert f"path={d / 'a.img'}" in capsys.readouterr().out
    assert run_commands(root, [f"/subsystems delete {S1}", f"/hosts delete {H1}", "/ports delete 1"]) == 0
    assert root.dump() == {"discovery": {}, "hosts": [], "ports": [], "subsystems": []}


def test_completion(env):
    fs, root, d = env
    run_commands(root, split_commands(script(d / "a.img")))
    shell = shellcmd.make_shell(root)
    node = shell._root_node.get_node(f"/subsystems/{S1}/allowed_hosts")
    assert node.ui_complete_delete({}, "nqn.2014", "nqn") == [H1 + " "]
    ports = shell._root_node.get_node("/ports/1/subsystems")
    assert ports.ui_complete_delete({}, "", "nqn") == [S1 + " "]


def test_saveconfig_restoreconfig(env, tmp_path):
    fs, root, d = env
    run_commands(root, split_commands(script(d / "a.img")))
    before = root.dump()
    f = tmp_path / "saved.json"
    assert run_commands(root, [f"saveconfig {f}", "clearconfig confirm=true"]) == 0
    assert root.dump()["subsystems"] == []
    assert json.loads(f.read_text()) == before
    assert run_commands(root, [f"restoreconfig {f}"]) == 0
    assert root.dump() == before


def test_cli_one_shot_forms(env, monkeypatch, capsys):
    fs, root, d = env
    monkeypatch.setattr(shellcmd, "Root", lambda path: root)
    assert cli.main(["shell", "-c", f"cd /hosts; create {H1}"]) == 0
    assert cli.main(["shell", "ls", "/hosts"]) == 0
    assert H1 in capsys.readouterr().out
    sc = d / "s.txt"
    sc.write_text(f"/hosts delete {H1}\n")
    assert cli.main(["shell", "-f", str(sc)]) == 0
    assert root.dump()["hosts"] == []
    assert cli.main(["shell", "cd", "/nope"]) == 1
