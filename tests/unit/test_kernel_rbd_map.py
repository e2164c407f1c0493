"""`nvmet apply` of an rbd namespace: krbd maps the image (kernel/rbd_map.py, the `rbd` tool stubbed at the
process boundary) and nvmet's namespace gets the device; applying again maps nothing; removing the namespace
unmaps it (a fake configfs with the kernel's rules, tests/unit/fake_nvmet.py)."""
import json

import pytest

from fake_nvmet import FakeNvmetFS
from nvmeof_roce.config import parse_config
from nvmeof_roce.kernel import apply as applymod
from nvmeof_roce.kernel.nvmet import NvmetError, Root
from nvmeof_roce.kernel.rbd_map import RbdTool
from nvmeof_roce.kernel.tool import ToolResult

SUB = "nqn.2024-01.io.example:rbd"


class FakeRbd:
    """The `rbd` tool as krbd answers it: map gives the next /dev/rbdN, showmapped lists them, unmap frees."""

    def __init__(self, refuse=""):
        self.mapped = []
        self.calls = []
        self.refuse = refuse
        self.next = 0

    def __call__(self, tool, args, package=None, timeout=None):
        assert tool == "rbd" and package == "ceph-common"
        args = [str(a) for a in args]
        self.calls.append(args)
        if args[0] == "showmapped":
            return ToolResult(["rbd"] + args, 0, json.dumps(self.mapped), "")
        if args[0] == "map":
            if self.refuse:
                return ToolResult(["rbd"] + args, 6, "", self.refuse)
            opts = dict(zip(args[1:-1:2], args[2:-1:2]))
            self.options = opts.get("--options")
            device = f"/dev/rbd{self.next}"
            self.next += 1
            self.mapped.append({"id": str(self.next - 1), "pool": opts["--pool"], "namespace": opts.get("--namespace", ""),
                                "name": args[-1], "snap": "-", "device": device})
            return ToolResult(["rbd"] + args, 0, device + "\n", "")
        if args[0] == "unmap":
            self.mapped = [m for m in self.mapped if m["device"] != args[-1]]
            return ToolResult(["rbd"] + args, 0, "", "")
        raise AssertionError(args)


def config(tmp_path, rbd_namespaces=({"nsid": 1, "image": "img1"},), **extra):
    (tmp_path / "a.img").write_bytes(b"")
    namespaces = [{"nsid": 9, "device": {"path": str(tmp_path / "a.img")}}]
    for n in rbd_namespaces:
        namespaces.append({"nsid": n["nsid"], "nvmeof_roce": {
            "backend": "rbd", "rbd": {"pool": "rbd", "image": n["image"], "conf": "/etc/ceph/c.conf", "id": "gw",
                                      **n.get("rbd", {})}, **extra}})
    return parse_config({"ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                                          "trsvcid": "4420"}, "subsystems": [SUB]}],
                         "subsystems": [{"nqn": SUB, "namespaces": namespaces}]}, "k.json")


@pytest.fixture
def kernel(tmp_path):
    fs = FakeNvmetFS(tmp_path / "cfs", devices=("/dev/rbd0", "/dev/rbd1", "/dev/rbd/rbd/img1"))
    return Root(fs.root, fs=fs, sys_module=fs.sys_module)


def device_path(root, nsid):
    ns = next(n for n in root.dump()["subsystems"][0]["namespaces"] if n["nsid"] == nsid)
    return ns["device"]["path"], ns["enable"]


def test_an_rbd_namespace_is_mapped_with_krbd_and_nvmet_serves_the_device(kernel, tmp_path):
    rbd = FakeRbd()
    tool = RbdTool(rbd, exists=lambda p: False, udev=True)
    steps = applymod.apply(kernel, config(tmp_path, [{"nsid": 1, "image": "img1", "rbd": {"namespace": "ns",
                                                                                          "keyring": "/k"}}]),
                           rbd=tool)
    assert ["map", "-c", "/etc/ceph/c.conf", "--id", "gw", "--pool", "rbd", "--namespace", "ns", "--keyring", "/k",
            "img1"] in rbd.calls
    assert steps[0].op == "rbd_map" and steps[0].value == "/dev/rbd0"
    assert device_path(kernel, 1) == ("/dev/rbd0", 1)
    rbd.calls.clear()
    assert applymod.apply(kernel, config(tmp_path, [{"nsid": 1, "image": "img1", "rbd": {"namespace": "ns",
                                                                                         "keyring": "/k"}}]),
                          rbd=tool) == []  # mapped already: reused, nothing changes
    assert [c[0] for c in rbd.calls] == ["showmapped"]


def test_the_stable_udev_path_is_preferred_when_it_leads_to_the_device(kernel, tmp_path):
    rbd = FakeRbd()
    tool = RbdTool(rbd, exists=lambda p: p == "/dev/rbd/rbd/img1",
                   realpath=lambda p: "/dev/rbd0" if p == "/dev/rbd/rbd/img1" else p, udev=True)
    applymod.apply(kernel, config(tmp_path), rbd=tool)
    assert device_path(kernel, 1) == ("/dev/rbd/rbd/img1", 1) and rbd.options is None
    # the namespace leaves the config: nvmet's namespace goes, then the image is unmapped
    steps = applymod.apply(kernel, config(tmp_path, []), rbd=tool)
    assert [s.op for s in steps][-1] == "rbd_unmap" and ["unmap", "/dev/rbd0"] in rbd.calls
    assert rbd.mapped == [] and [n["nsid"] for n in kernel.dump()["subsystems"][0]["namespaces"]] == [9]


def test_a_dry_run_plans_the_map_and_the_unmap_and_runs_neither(kernel, tmp_path):
    rbd = FakeRbd()
    tool = RbdTool(rbd, exists=lambda p: False)
    steps = applymod.apply(kernel, config(tmp_path), dry_run=True, rbd=tool)
    assert steps[0].op == "rbd_map" and "rbd/img1" in steps[0].desc
    assert any(s.rel.endswith("namespaces/1/device_path") and s.value == "/dev/rbd/rbd/img1" for s in steps)
    assert [c[0] for c in rbd.calls] == ["showmapped"] and kernel.dump()["subsystems"] == []
    applymod.apply(kernel, config(tmp_path), rbd=tool)
    steps = applymod.apply(kernel, config(tmp_path, []), dry_run=True, rbd=tool)
    assert steps[-1].op == "rbd_unmap" and steps[-1].rel == "/dev/rbd0" and rbd.mapped  # planned, not run


def test_two_images_and_a_clear_unmaps_both(kernel, tmp_path, monkeypatch):
    rbd = FakeRbd()
    tool = RbdTool(rbd, exists=lambda p: False, udev=False)  # no udevd (the lab's guest): -o noudev
    cfg = config(tmp_path, [{"nsid": 1, "image": "img1"}, {"nsid": 2, "image": "img2"}])
    applymod.apply(kernel, cfg, rbd=tool)
    assert device_path(kernel, 2) == ("/dev/rbd1", 1) and rbd.options == "noudev"
    monkeypatch.setattr(applymod.rbd_map, "RbdTool", lambda: tool)  # what remove() and the CLI make
    gone = applymod.remove(kernel, cfg)
    assert "/dev/rbd0" in gone and "/dev/rbd1" in gone and rbd.mapped == []
    assert ["unmap", "--options", "noudev", "/dev/rbd1"] in rbd.calls


def test_what_the_kernel_cannot_take_of_an_rbd_namespace_is_refused_before_mapping(kernel, tmp_path):
    rbd = FakeRbd()
    with pytest.raises(NvmetError) as err:
        applymod.apply(kernel, config(tmp_path, block_size=4096), rbd=RbdTool(rbd))
    assert "block_size" in str(err.value) and rbd.calls == []


def test_a_map_the_kernel_refuses_names_the_image_and_the_fix(kernel, tmp_path):
    rbd = FakeRbd(refuse="rbd: sysfs write failed\nRBD image feature set mismatch. You can disable features "
                         "unsupported by the kernel with \"rbd feature disable rbd/img1 object-map\".")
    with pytest.raises(NvmetError) as err:
        applymod.apply(kernel, config(tmp_path), rbd=RbdTool(rbd, exists=lambda p: False))
    assert "rbd map rbd/img1" in str(err.value) and "rbd feature disable rbd/img1" in err.value.fix
    assert kernel.dump()["subsystems"] == []  # nothing changed in nvmet


# --- the image itself (bench --rbd makes, looks at and removes its image through the same wrapper) -------------

class FakeImages:
    """`rbd info/create/rm` as the cluster answers them, the images kept by name."""

    def __init__(self, fail=""):
        self.images = {}
        self.calls = []
        self.fail = fail

    def __call__(self, tool, args, package=None, timeout=None):
        assert tool == "rbd" and package == "ceph-common"
        args = [str(a) for a in args]
        self.calls.append(args)
        name = args[-1]
        if self.fail:
            return ToolResult(["rbd"] + args, 110, "", self.fail)
        if args[0] == "info":
            if name not in self.images:
                return ToolResult(["rbd"] + args, 2, "", f"rbd: error opening image {name}: (2) No such file or "
                                                          "directory")
            return ToolResult(["rbd"] + args, 0, json.dumps(self.images[name]), "")
        if args[0] == "create":
            opts = dict(zip(args[1:-1:2], args[2:-1:2]))
            self.images[name] = {"name": name, "size": int(opts["--size"].rstrip("M")) << 20,
                                 "features": opts["--image-feature"].split(",")}
            return ToolResult(["rbd"] + args, 0, "", "")
        if args[0] == "rm":
            self.images.pop(name)
            return ToolResult(["rbd"] + args, 0, "", "")
        raise AssertionError(args)


def test_create_info_exists_and_remove_an_image():
    from nvmeof_roce.config.rbd import RbdSettings
    rbd = FakeImages()
    tool = RbdTool(rbd, udev=False)
    s = RbdSettings(pool="rbd", image="bench", conf="/etc/ceph/c.conf", client_id="gw", namespace="ns",
                    keyring="/k")
    assert tool.info(s) is None and tool.exists(s) is False
    tool.create(s, (512 << 20) + 1)  # rounded up to the next MiB
    assert rbd.calls[-1] == ["create", "--size", "513M", "--image-feature", "layering", "-c", "/etc/ceph/c.conf",
                             "--id", "gw", "--pool", "rbd", "--namespace", "ns", "--keyring", "/k", "bench"]
    created = rbd.calls[-1]
    assert tool.exists(s) and tool.info(s)["size"] == 513 << 20
    assert rbd.calls[-1][:3] == ["info", "--format", "json"] and rbd.calls[-1][3:] == created[5:]
    tool.create(RbdSettings(pool="rbd", image="two"), 1 << 20, features=("layering", "exclusive-lock"))
    assert rbd.calls[-1][:5] == ["create", "--size", "1M", "--image-feature", "layering,exclusive-lock"]
    tool.remove(s)
    assert rbd.calls[-1][:2] == ["rm", "--no-progress"] and tool.exists(s) is False


def test_a_cluster_that_fails_names_the_image_and_the_fix():
    from nvmeof_roce.config.rbd import RbdSettings
    tool = RbdTool(FakeImages(fail="rbd: couldn't connect to the cluster!\n(110) Connection timed out"), udev=True)
    s = RbdSettings(pool="rbd", image="bench")
    with pytest.raises(NvmetError, match="(?s)rbd info rbd/bench: .*timed out") as err:
        tool.exists(s)
    assert "ceph -s" in err.value.fix
    with pytest.raises(NvmetError, match="rbd create rbd/bench") as err:
        tool.create(s, 1 << 20)
    assert "ceph df" in err.value.fix
    with pytest.raises(NvmetError, match="rbd rm rbd/bench") as err:
        tool.remove(s)
    assert "rbd status rbd/bench" in err.value.fix
