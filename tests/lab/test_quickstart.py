"""docs/hardware.md's "Real NICs in 10 minutes", run as written: the section's ```sh blocks are read out of the
document (so it cannot drift from what is tested) and run one after another with bash -e, with the words in
capitals filled in as a reader would: TARGET_IP the lab's rxe address, SSD_ID a /dev/disk/by-id name this test
gives a null_blk device (the guest has no udev), NVME_DEVICE the namespace the connect gave.

The guest's PID 1 is not systemd, so `systemctl` is tests/lab/unit_runner.py: it runs the unit that
`install-units` installed (its ExecStart, notify socket, no capabilities, LimitMEMLOCK=infinity) as systemd does.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nvmeof_roce.bench.kernel_glue import NullBlk
from targetproc import LAB_IP, disconnect_all_quietly, namespaces_of

pytestmark = [pytest.mark.lab, pytest.mark.extended]  # doctor twice, a unit, fio: minutes under TCG

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Real NICs in 10 minutes"
SSD_ID = "nvme-Lab_null_blk_SSD_nvmeof-roce-quickstart"
UNIT = "nvmeof-roce-target@ssd"


def quickstart_blocks():
    text = (REPO / "docs" / "hardware.md").read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```sh\n(.*?)```", text[start:end], re.S)


def test_real_nics_in_10_minutes_runs_as_written(tmp_path):
    blocks = quickstart_blocks()
    nqn = re.search(r"host connect -a TARGET_IP -n (\S+)", "\n".join(blocks)).group(1)
    null = NullBlk(name="quickstart", size_mb=256)
    by_id = f"/dev/disk/by-id/{SSD_ID}"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests/lab/unit_runner.py'} \"$@\"\n")
    (bin_dir / "systemctl").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    values = {"TARGET_IP": LAB_IP, "SSD_ID": SSD_ID}
    outputs = []
    try:
        device = null.create()
        os.makedirs("/dev/disk/by-id", exist_ok=True)
        if os.path.lexists(by_id):
            os.unlink(by_id)
        os.symlink(os.path.relpath(device, "/dev/disk/by-id"), by_id)
        for block in blocks:
            if "NVME_DEVICE" in block:
                (values["NVME_DEVICE"],) = namespaces_of(nqn)
            script = block
            for word, value in values.items():
                script = script.replace(word, value)
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True,
                                  timeout=900)
            outputs.append(proc.stdout + proc.stderr)
            print(f"$ {script}\n{outputs[-1]}")
            assert proc.returncode == 0, f"{script}\nexit {proc.returncode}:\n{outputs[-1][-4000:]}"
        target_out, export_out, host_out, fio_out = outputs[0], outputs[1], outputs[2], outputs[3]
        # what each step must have shown, beyond its exit status
        assert "/etc/nvmeof-roce/fabric/plan.json" in target_out
        assert SSD_ID in export_out and "/etc/nvmeof-roce/ssd.json: OK" in export_out
        with open("/etc/systemd/system/nvmeof-roce-target@ssd.service.d/nvmeof-roce-paths.conf") as f:
            drop_in = f.read()
        assert f"DeviceAllow={by_id} rw" in drop_in, drop_in  # the SSD's device, by its stable name
        assert f"{UNIT}: started (READY=1)" in export_out and nqn in export_out  # target status lists it
        assert os.path.basename(values["NVME_DEVICE"]) in host_out  # host list showed it
        assert re.search(r"read: IOPS=\d", fio_out), fio_out
        # the unit serves under no capability: the service's process
        with open("/run/unit-runner/" + UNIT + ".pid") as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/status") as f:
            caps = dict(line.split(":", 1) for line in f if line.startswith("Cap"))
        assert caps["CapEff"].strip() == "0000000000000000", caps
    finally:
        disconnect_all_quietly()
        stopped = subprocess.run(["sh", str(bin_dir / "systemctl"), "stop", UNIT], capture_output=True, text=True)
        print(stopped.stdout + stopped.stderr)
        if os.path.lexists(by_id):
            os.unlink(by_id)
        null.remove()
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    with open(f"/run/unit-runner/{UNIT}.log") as f:
        log = f.read()
    assert "Traceback" not in log, log[-4000:]
    saved = json.loads(Path("/etc/nvmeof-roce/ssd.json").read_text())  # --persist left it loadable
    assert saved["subsystems"][0]["namespaces"][0]["device"]["path"] == by_id
