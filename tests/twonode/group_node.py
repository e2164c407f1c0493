"""One node's side of the gateway group scenarios: `python3 tests/twonode/group_node.py target|host SCENARIO`.

Two guests of `nvmeof-roce lab run --nodes 2` (test_group_two_node.py starts them).  The *target* node (10.99.1.1)
runs the development Ceph cluster and gateway gw-a (home of ANA group 2); the *host* node (10.99.1.2) runs gateway
gw-b (home of ANA group 3) and the kernel host, connected to both gateways (native multipath: a path through
each).  One subsystem, two RBD namespaces on the native data path: nsid 1 in ANA group 2, nsid 2 in group 3.
Results and both gateways' logs go to /mnt/share for the host-side test.

Scenarios:
  kill  fio crc32c verify (QD32, 4-128 KiB) on both namespaces; gw-a SIGKILLed under it; gw-b fences gw-a's
        RADOS clients and takes ANA group 2; fio goes on through gw-b.  Then a resize by RPC on gw-b seen by the
        host on both paths; gw-a restarted, rejoins, and takes group 2 back on failback (RPC on gw-a).
  cut   the host node cut from the Ceph cluster (its TCP to the other node dropped; RoCE still flows) under fio
        verify on namespace 2 (gw-b's): gw-b stops serving group 3 before gw-a fences it and takes it; I/O
        resumes through gw-a; the cluster back, gw-b finds itself fenced and exits with EXIT_FENCED.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, "/mnt/project")
from nvmeof_roce import rendezvous  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from node import sh  # noqa: E402  (the two-node scenarios' one subprocess helper)

SHARE = "/mnt/share"
TARGET_IP, HOST_IP = "10.99.1.1", "10.99.1.2"
NQN = "nqn.2024-01.io.nvmeof-roce:group"
GROUP = "lab"
LEASE = 10
CONF = f"{SHARE}/ceph.conf"
RESULT = {}


def wait(name, timeout):
    """rendezvous.wait, given up at once when the other node failed (it signals `failed-ROLE`)."""
    other = "host" if ROLE == "target" else "target"
    deadline = time.monotonic() + timeout
    while True:
        try:
            return rendezvous.wait(name, 1)
        except Exception:
            if (rendezvous.sync_dir() / f"failed-{other}").exists():
                raise SystemExit(f"the {other} node failed: giving up waiting for {name}")
            if time.monotonic() > deadline:
                raise


def step(name):
    print(f"[group {ROLE}] {time.strftime('%H:%M:%S')} {name}", flush=True)


def save():
    with open(f"{SHARE}/{ROLE}-result.json", "w") as f:
        json.dump(RESULT, f, indent=1)


def clock_offset():
    """This guest's wall clock minus the lab host's (a file's mtime on the share is the host's clock): the
    two gateways' log times are compared on the host's clock."""
    path = Path(SHARE) / f"clock-{ROLE}"
    before = time.time()
    path.write_text("now")
    after = time.time()
    return round((before + after) / 2 - path.stat().st_mtime, 3)


# -- gateways

def gateway_config(name, address, home, seed):
    config = {"hosts": [], "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": address,
                                                            "trsvcid": "4420"}, "subsystems": []}],
              "nvmeof_roce": {"group": {"name": GROUP, "gateway": name, "ana_groups": [home], "conf": CONF,
                                        "lease": LEASE}}}
    if seed:
        def rbd(nsid, image, grpid):
            return {"nsid": nsid, "ana_grpid": grpid, "resv": {"enable": "1"}, "nvmeof_roce": {
                "backend": "rbd", "rbd": {"pool": "rbd", "image": image, "conf": CONF, "native": True}}}
        config["subsystems"] = [{"nqn": NQN, "attr": {"allow_any_host": "1"},
                                 "namespaces": [rbd(1, "gw1", 2), rbd(2, "gw2", 3)]}]
    return config


def start_gateway(name, address, home, seed=False, tag=""):
    path = f"/tmp/{name}.json"
    with open(path, "w") as f:
        json.dump(gateway_config(name, address, home, seed), f)
    ready = f"/tmp/{name}.ready"
    if os.path.exists(ready):
        os.unlink(ready)
    log = open(f"{SHARE}/{name}{tag}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "nvmeof_roce", "target", "serve", path, "--ready-file", ready,
                             "--rpc-socket", f"/run/{name}.sock"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start:\n{open(f'{SHARE}/{name}{tag}.log').read()[-4000:]}")
        time.sleep(0.2)
    step(f"{name} serving")
    return proc


def rpc(name, method, params=None):
    proc = sh(sys.executable, "-m", "nvmeof_roce", "rpc", "--socket", f"/run/{name}.sock", method,
              json.dumps(params or {}), check=False, timeout=120)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return {"stdout": proc.stdout, "stderr": proc.stderr, "returncode": proc.returncode}


def group_state():
    """The group's state object as Ceph holds it (members and their clients, ANA owners)."""
    from nvmeof_roce.ceph.bindings import rados_and_rbd
    from nvmeof_roce.ceph.group import GroupStore
    rados, _ = rados_and_rbd()
    with rados.Rados(conffile=CONF) as client, client.open_ioctx("rbd") as ioctx:
        snap = GroupStore(ioctx, GROUP).read()
    return {"members": {g: {"addr": m.addr, "fence_addrs": m.fence_addrs} for g, m in snap.members.items()},
            "owners": {str(g): a.owner.gateway if a.owner else None for g, a in snap.ana_groups.items()}}


def blocklist():
    out = sh("ceph", "-c", CONF, "osd", "blocklist", "ls").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith("listed")]


def start_cluster():
    from nvmeof_roce.ceph.devcluster import DevCluster
    cluster = DevCluster(Path("/tmp/ceph"), addr=TARGET_IP, port=6789).start()
    sh("cp", str(cluster.conf), CONF)
    for image in ("gw1", "gw2"):
        cluster.rbd("create", "--size", "256M", f"rbd/{image}")
    return cluster


# -- the host's kernel side

def ana_paths(nsid):
    """{controller's address: ANA state} of namespace `nsid`'s paths (sysfs nvmeXcYnZ/ana_state)."""
    out = {}
    for subsys in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
        if open(f"{subsys}/subsysnqn").read().strip() != NQN:
            continue
        for ctrl in glob.glob(f"{subsys}/nvme[0-9]*"):
            if "n" in os.path.basename(ctrl)[4:]:
                continue
            addr = open(f"{ctrl}/address").read().strip()
            for path in glob.glob(f"{ctrl}/nvme*c*n*"):
                if int(open(f"{path}/nsid").read()) != nsid:
                    continue
                state = open(f"{path}/ana_state").read().strip() if os.path.exists(f"{path}/ana_state") else "?"
                out[addr.split(",")[0]] = state
    return out


def head(nsid):
    """The multipath head's block device of namespace `nsid`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for subsys in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
            if open(f"{subsys}/subsysnqn").read().strip() == NQN:
                for disk in glob.glob(f"{subsys}/nvme*n*"):  # the heads' names count, they are not NSIDs
                    name = os.path.basename(disk)
                    if "c" not in name and int(open(f"/sys/block/{name}/nsid").read()) == nsid:
                        return "/dev/" + name
        time.sleep(0.2)
    raise SystemExit(f"no multipath head for namespace {nsid}")


def connect_both():
    sh("modprobe", "-a", "nvme_rdma", "nvme_fabrics")
    for addr in (TARGET_IP, HOST_IP):
        sh("nvme", "connect", "-t", "rdma", "-a", addr, "-s", "4420", "-n", NQN, "-i", "2",
           "--ctrl-loss-tmo", "600", "--reconnect-delay", "2")
    return head(1), head(2)


def resv_report(device):
    """nvme resv-report through the multipath head (the optimized path): holder, type, generation, registrants."""
    out = json.loads(sh("nvme", "resv-report", device, "--eds", "-o", "json").stdout)
    return {"gen": out.get("gen"), "rtype": out.get("rtype"),
            "regctlext": [{k: r.get(k) for k in ("hostid", "rkey", "rcsts")} for r in out.get("regctlext", [])]}


def wait_for(what, probe, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"{what}: not within {timeout} s (last: {probe()!r})")


def fio(device, name, runtime, size="128M"):
    return subprocess.Popen(
        ["fio", f"--name={name}", f"--filename={device}", "--ioengine=libaio", "--direct=1", "--rw=randwrite",
         "--bssplit=4k/25:16k/25:64k/25:128k/25", "--iodepth=32", f"--size={size}", f"--runtime={runtime}",
         "--time_based", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--verify_backlog=256",
         "--verify_state_save=0", "--output-format=json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fio_result(proc, timeout=600):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        err = "fio killed: still running\n" + err
    job = json.loads(out[out.index("{"):])["jobs"][0] if "{" in out else {}
    write = job.get("write", {})
    return {"error": job.get("error"), "returncode": proc.returncode, "stderr": err[-1500:],
            "write_ios": write.get("total_ios"), "verified_reads": job.get("read", {}).get("total_ios"),
            "max_write_ms": round(write.get("clat_ns", {}).get("max", 0) / 1e6, 1)}


# -- scenario kill

def target_up():
    """The Ceph cluster and gw-a (seeding the group), then the host node is told."""
    RESULT["clock_offset"] = clock_offset()
    step("Ceph cluster")
    cluster = start_cluster()
    gw_a = start_gateway("gw-a", TARGET_IP, 2, seed=True)
    rendezvous.signal("gw-a-ready")
    return cluster, gw_a


def target_down(cluster, gw_a):
    """Once the host node is done: the group's state and the blocklist as Ceph has them, gw-a stopped."""
    wait("host.done", 1500)
    RESULT["blocklist"] = RESULT.get("blocklist") or blocklist()
    RESULT["state_at_end"] = group_state()
    gw_a.send_signal(signal.SIGTERM)
    RESULT["gw_a_exit"] = gw_a.wait(60)
    save()
    cluster.stop()


def host_up():
    """gw-b, once gw-a serves; the kernel host connected to both: the heads of namespaces 1 and 2."""
    RESULT["clock_offset"] = clock_offset()
    wait("gw-a-ready", 900)
    gw_b = start_gateway("gw-b", HOST_IP, 3)
    return (gw_b,) + connect_both()


def target_kill():
    cluster, gw_a = target_up()
    wait("kill-a", 900)
    gw_a.send_signal(signal.SIGKILL)
    RESULT["killed_at"] = time.time()
    gw_a.wait(30)
    step("gw-a killed")
    RESULT["state_before_take_over"] = group_state()
    rendezvous.signal("a-killed")
    wait("b-took-over", 300)
    RESULT["blocklist"] = blocklist()
    RESULT["state_after_take_over"] = group_state()
    wait("restart-a", 900)
    gw_a = start_gateway("gw-a", TARGET_IP, 2, tag="-restarted")
    rendezvous.signal("a-restarted")
    wait("failback-asked", 600)
    RESULT["failback"] = rpc("gw-a", "nvmeof_group_failback", {"ana_group": 2})
    target_down(cluster, gw_a)


def host_kill():
    gw_b, ns1, ns2 = host_up()
    RESULT["paths_at_start"] = {"1": wait_for("two paths of ns 1", lambda: len(ana_paths(1)) == 2 and ana_paths(1)),
                                "2": wait_for("two paths of ns 2", lambda: len(ana_paths(2)) == 2 and ana_paths(2))}
    step(f"paths {RESULT['paths_at_start']}")
    # a resize by RPC on gw-b (ns 2's owner): the image grows; gw-a follows it through the image's header watch;
    # the host sees the new size on the head and on both paths (each gateway's notice)
    RESULT["resize"] = rpc("gw-b", "nvmf_subsystem_resize_ns", {"nqn": NQN, "nsid": 2, "size": "320M"})
    dev2 = os.path.basename(ns2)
    RESULT["resized_head_bytes"] = wait_for("the host sees ns 2 at 320M", lambda: (
        int(open(f"/sys/block/{dev2}/size").read()) * 512 == 320 << 20
        and int(open(f"/sys/block/{dev2}/size").read()) * 512), 120)

    def path_sizes():
        return {os.path.basename(p): int(open(f"{p}/size").read()) * 512
                for p in glob.glob("/sys/class/nvme-subsystem/*/nvme[0-9]*/nvme*c*n*")
                if int(open(f"{p}/nsid").read()) == 2}
    try:
        RESULT["path_sizes_ns2"] = wait_for("both paths of ns 2 at 320M", lambda: (
            len(path_sizes()) == 2 and set(path_sizes().values()) == {320 << 20} and path_sizes()), 60)
    except SystemExit:
        RESULT["path_sizes_ns2"] = path_sizes()
    # a reservation through gw-a (the owner of ns 1's group): Register, then Acquire Write Exclusive
    sh("nvme", "resv-register", ns1, "--nrkey=0xabc", "--rrega=0")
    sh("nvme", "resv-acquire", ns1, "--crkey=0xabc", "--rtype=1", "--racqa=0")
    RESULT["resv_through_a"] = resv_report(ns1)
    runs = {"1": fio(ns1, "ns1", 90), "2": fio(ns2, "ns2", 90)}
    time.sleep(20)
    rendezvous.signal("kill-a")
    wait("a-killed", 120)
    RESULT["paths_after_kill"] = {"1": wait_for("ns 1 optimized through gw-b",
                                                lambda: ana_paths(1).get(f"traddr={HOST_IP}") == "optimized"
                                                and ana_paths(1), 120)}
    RESULT["took_over_seen_at"] = time.time()
    rendezvous.signal("b-took-over")
    # the same reservation reported through gw-b, and enforced there: another host's Write is refused
    RESULT["resv_through_b"] = resv_report(ns1)
    other = sh(sys.executable, "-m", "nvmeof_roce", "initiator", "write", "-a", HOST_IP, "-s", "4420", "-n", NQN,
               "-q", "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000b2",
               "-I", "00000000-0000-4000-8000-0000000000b2", "--nsid", "1", "--slba", "0", "--blocks", "1",
               check=False, timeout=120)
    RESULT["other_host_write_through_b"] = {"returncode": other.returncode,
                                            "output": (other.stdout + other.stderr)[-800:]}
    for nsid, proc in runs.items():
        RESULT[f"fio_{nsid}"] = fio_result(proc)
    step(f"fio {RESULT['fio_1']} {RESULT['fio_2']}")
    rendezvous.signal("restart-a")
    wait("a-restarted", 300)
    wait_for("gw-a's path back", lambda: len(ana_paths(1)) == 2 and "?" not in ana_paths(1).values(), 180)
    rendezvous.signal("failback-asked")
    back = {f"traddr={TARGET_IP}": "optimized", f"traddr={HOST_IP}": "inaccessible"}
    RESULT["paths_after_failback"] = {"1": wait_for("ns 1 optimized through gw-a again, inaccessible through gw-b",
                                                    lambda: ana_paths(1) == back and ana_paths(1), 180)}
    RESULT["fio_after_failback"] = fio_result(fio(ns1, "ns1-back", 15, size="32M"))
    RESULT["gw_b_status"] = rpc("gw-b", "nvmeof_group_status")
    save()
    for addr in (TARGET_IP, HOST_IP):
        sh("nvme", "disconnect", "-n", NQN, check=False, timeout=60)
    gw_b.send_signal(signal.SIGTERM)
    RESULT["gw_b_exit"] = gw_b.wait(60)
    save()
    rendezvous.signal("host.done")


# -- scenario cut

def cut_from_cluster():
    """This node loses the Ceph cluster (TCP to and from the other node dropped) while RoCE (UDP 4791) still
    flows: gw-b cannot renew its lease, the host still reaches gw-a.  (Taking the whole link down instead hits
    Soft-RoCE's flap defect on this node: docs/two-node.md, the flap scenarios.)"""
    sh("nft", "add", "table", "inet", "groupcut")
    for chain, hook, match in (("out", "output", "daddr"), ("in", "input", "saddr")):
        sh("nft", "add", "chain", "inet", "groupcut", chain,
           f"{{ type filter hook {hook} priority 0 ; }}")
        sh("nft", "add", "rule", "inet", "groupcut", chain, "ip", match, TARGET_IP, "meta", "l4proto", "tcp", "drop")

def target_cut():
    target_down(*target_up())


def host_cut():
    gw_b, _ns1, ns2 = host_up()
    RESULT["paths_at_start"] = {"2": wait_for("two paths of ns 2", lambda: len(ana_paths(2)) == 2 and ana_paths(2))}
    run = fio(ns2, "ns2", 120)
    time.sleep(15)
    RESULT["cut_at"] = time.time()
    cut_from_cluster()
    step("cut from the cluster")
    RESULT["paths_after_cut"] = {"2": wait_for("ns 2 optimized through gw-a",
                                               lambda: ana_paths(2).get(f"traddr={TARGET_IP}") == "optimized"
                                               and ana_paths(2), 6 * LEASE)}
    time.sleep(LEASE)
    sh("nft", "delete", "table", "inet", "groupcut")
    RESULT["restored_at"] = time.time()
    step("cluster reachable again")
    RESULT["fio_2"] = fio_result(run)
    RESULT["paths_at_end"] = {"2": ana_paths(2)}
    try:
        RESULT["gw_b_exit"] = gw_b.wait(120)  # fenced: it stops by itself
    except subprocess.TimeoutExpired:
        gw_b.send_signal(signal.SIGTERM)
        RESULT["gw_b_exit"] = f"still running; SIGTERM: {gw_b.wait(60)}"
    save()
    sh("nvme", "disconnect", "-n", NQN, check=False, timeout=60)
    rendezvous.signal("host.done")


if __name__ == "__main__":
    ROLE, SCENARIO = sys.argv[1], sys.argv[2]
    try:
        globals()[f"{ROLE}_{SCENARIO}"]()
    except BaseException:
        rendezvous.signal(f"failed-{ROLE}")  # the other node stops waiting for this one
        save()
        raise
