"""NQNs from the wire are the host's words: a control character in one cannot forge a log line."""
import logging

from nvmeof_roce.nvme import fabrics as F

from loopback_env import SUB_RAM, SUB_ONLY_A, raw_connect

EVIL = "nqn.2014-08.org.evil:host\n2026-01-01 00:00:00 nvmeof_roce.engine.core INFO: forged\x1b[2J"


def test_control_characters_of_a_host_nqn_are_escaped_in_every_log_line(env, caplog):
    with caplog.at_level(logging.DEBUG, logger="nvmeof_roce"):
        q, cqe = raw_connect(env.connector(), SUB_RAM, EVIL)  # allow_any_host: accepted
        assert cqe.status == 0
        raw_connect(env.connector(), SUB_ONLY_A, EVIL)  # refused, and logged
        raw_connect(env.connector(), "nqn.2024-01.io.test:no\rsuch", EVIL)
        env.target.close()
        env.fabric.pump()
    text = [r.getMessage() for r in caplog.records]
    assert any("nqn.2014-08.org.evil:host\\x0a2026" in m for m in text)
    for m in text:
        assert "\n" not in m and "\r" not in m and "\x1b" not in m, m
    ctrl = next(iter(env.target.subsystems[SUB_RAM].controllers.values()), None)
    assert ctrl is None or "\n" not in ctrl.hostnqn
