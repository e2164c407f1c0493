"""A subsystem's `version` attribute must fit the VS register: refused by the config (target check, reload),
never an Internal Error at Identify."""
import pytest

from nvmeof_roce.config import ConfigError, parse_config

from loopback_env import ADDR1, Env, port, ram_ns

SUB = "nqn.2024-01.io.test:ver"


def _config(version):
    return {"ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "attr": {"version": version}, "namespaces": [ram_ns(1)]}]}


@pytest.mark.parametrize("version", ["70000.0", "1.300", "1.3.256", "0.9", "99999999999999999999.1"])
def test_a_version_out_of_range_is_refused_naming_the_field(version):
    with pytest.raises(ConfigError) as err:
        parse_config(_config(version), "t")
    assert err.value.where == "subsystems[0].attr.version" and "VS register" in err.value.problem


@pytest.mark.parametrize("version,vs", [("1.3", 0x10300), ("2.0.255", 0x200FF), ("65535.255", 0xFFFFFF00)])
def test_a_version_in_range_is_what_identify_and_vs_report(version, vs):
    env = Env(_config(version))
    ctrl = env.connect(SUB)
    assert ctrl.id_ctrl.ver == vs
    assert env.target.internal_errors == 0
    ctrl.close()
    env.close()
