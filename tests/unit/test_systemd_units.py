"""The shipped systemd units: installed with this nvmeof-roce's path, accepted by systemd-analyze verify."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from nvmeof_roce import cli
from nvmeof_roce.systemd import UNITS, render


def test_units_say_what_the_issue_asks():
    target = render("nvmeof-roce-target@.service", "/opt/x/nvmeof-roce")
    for line in ("Type=notify", "LimitMEMLOCK=infinity", "Restart=on-failure", "ExecReload=/bin/kill -HUP $MAINPID",
                 "ExecStart=/opt/x/nvmeof-roce target serve /etc/nvmeof-roce/%i.json "
                 "--rpc-socket /run/nvmeof-roce/%i.sock"):
        assert line in target.splitlines()
    nvmet = render("nvmeof-roce-nvmet.service", "/opt/x/nvmeof-roce")
    assert "ExecStart=/opt/x/nvmeof-roce nvmet restore /etc/nvmet/config.json" in nvmet.splitlines()
    assert "/usr/bin/nvmeof-roce" not in nvmet + target


def test_install_units_and_systemd_analyze_verify(tmp_path, capsys):
    exe = tmp_path / "nvmeof-roce"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m nvmeof_roce \"$@\"\n")
    exe.chmod(0o755)
    code = cli.main(["install-units", "--dest", str(tmp_path / "units"), "--executable", str(exe), "--no-reload",
                     "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and sorted(os.path.basename(u) for u in result["units"]) == sorted(UNITS)
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed here (the lab guest checks the units too)")
    units = tmp_path / "units"
    os.symlink("nvmeof-roce-target@.service", units / "nvmeof-roce-target@demo.service")
    proc = subprocess.run(["systemd-analyze", "verify", str(units / "nvmeof-roce-nvmet.service"),
                           str(units / "nvmeof-roce-target@demo.service")], capture_output=True, text=True,
                          timeout=60)
    # verify exits 0 even for unknown settings; it names the file and line on stderr
    assert proc.returncode == 0 and "nvmeof-roce" not in proc.stderr, proc.stderr
