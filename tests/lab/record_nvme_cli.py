"""Record nvme-cli's output against our target, for the unit tests' fixtures (not a test).

Run in a lab guest of the nvme-cli version to record (its `nvme version` names the directory):

    nvmeof-roce lab run --kernel 6.12 --share OUT -- python3 tests/lab/record_nvme_cli.py /mnt/share
    nvmeof-roce lab run --kernel trixie --share OUT -- python3 tests/lab/record_nvme_cli.py /mnt/share

It serves one subsystem (two namespaces) with `target serve`, then writes OUT/nvme-cli-VERSION/: version.txt,
discover.json, connect.json (and connect.stderr), list.json, list-verbose.json, list-subsys.json, and the same
listings with nothing connected (list-empty.json, list-subsys-empty.json), plus origin.txt (kernel, nvme-cli,
libnvme, host NQN and ID files).  The unit tests read them from tests/unit/fixtures/nvme-cli-VERSION/.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, ram_namespace  # noqa

NQN = "nqn.2024-01.io.nvmeof-roce:record"


def nvme(*args):
    return subprocess.run(["nvme", *args], capture_output=True, text=True, timeout=120)


def main(out_root: str) -> int:
    subprocess.run(["modprobe", "-a", "nvme_rdma", "nvme_fabrics"], check=True)
    version = nvme("version").stdout
    m = re.search(r"nvme version (\S+)", version)
    out = os.path.join(out_root, f"nvme-cli-{m.group(1) if m else 'unknown'}")
    os.makedirs(out, exist_ok=True)

    def save(name, text):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)

    save("version.txt", version)
    ids = {p: open(p).read().strip() for p in ("/etc/nvme/hostnqn", "/etc/nvme/hostid") if os.path.exists(p)}
    save("origin.txt", f"kernel: {os.uname().release}\n{version}" +
         "".join(f"{p}: {v}\n" for p, v in ids.items()))
    save("list-empty.json", nvme("list", "-o", "json").stdout)
    save("list-subsys-empty.json", nvme("list-subsys", "-o", "json").stdout)
    tmp = tempfile.mkdtemp()
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1", "serial": "REC00001", "model": "nvmeof-roce lab"},
                   "allowed_hosts": [], "namespaces": [ram_namespace(1, "64M", 512), ram_namespace(2, "32M", 4096)]}])
    target = ServedTarget(cfg, os.path.join(tmp, "target.json")).start()
    try:
        save("discover.json", nvme("discover", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-o", "json").stdout)
        connect = nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN, "-o", "json")
        save("connect.json", connect.stdout)
        save("connect.stderr", connect.stderr)
        namespaces_of(NQN, expect=2)
        save("list.json", nvme("list", "-o", "json").stdout)
        save("list-verbose.json", nvme("list", "-o", "json", "--verbose").stdout)
        save("list-subsys.json", nvme("list-subsys", "-o", "json").stdout)
        dup = nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN, "-o", "json")
        save("connect-again.stderr", f"exit {dup.returncode}\n{dup.stderr}")
        save("disconnect.txt", nvme("disconnect", "-n", NQN).stdout)
    finally:
        disconnect_all_quietly()
        target.stop()
    print(f"recorded nvme-cli output in {out}: {', '.join(sorted(os.listdir(out)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
