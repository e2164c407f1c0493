"""docs/hardware.md's "Real NICs in 10 minutes" holds the steps it promises, and its config is one the userspace
target takes (tests/lab/test_quickstart.py runs the whole section in the lab)."""
import json
import re
from pathlib import Path

from nvmeof_roce.config import parse_config, raise_all, validate_for_userspace

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Real NICs in 10 minutes"


def quickstart_blocks():
    text = (REPO / "docs" / "hardware.md").read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```sh\n(.*?)```", text[start:end], re.S)


def test_the_section_has_each_step_in_order():
    commands = "\n".join(quickstart_blocks())
    steps = ["nvmeof-roce doctor\n", "nvmeof-roce fabric plan", "nvmeof-roce doctor --plan",
             "/dev/disk/by-id/SSD_ID", "nvmeof-roce target check /etc", "nvmeof-roce install-units",
             "nvmeof-roce target check --unit ssd", "systemctl enable --now nvmeof-roce-target@ssd", "nvmeof-roce host connect -a TARGET_IP", "fio "]
    where = [commands.find(step) for step in steps]
    assert -1 not in where, [s for s, w in zip(steps, where) if w == -1]
    assert where == sorted(where), "the steps are out of order"


def test_the_section_s_config_is_served_as_written():
    (heredoc,) = re.findall(r"<<'EOF'\n(.*?)\nEOF\n", "\n".join(quickstart_blocks()), re.S)
    data = json.loads(heredoc.replace("TARGET_IP", "192.0.2.1").replace("SSD_ID", "nvme-Example_SSD_1234"))
    config = parse_config(data, "ssd.json")
    raise_all(validate_for_userspace(config))
    (sub,) = config.subsystems
    assert sub.namespaces[0].path == "/dev/disk/by-id/nvme-Example_SSD_1234"
    assert config.ports[0].traddr == "192.0.2.1" and sub.nqn in config.ports[0].subsystems
