"""An RBD namespace's config (config/rbd.py, the rbd entry of config/backends.py): refusals naming the field,
and what `target check` says of it without the cluster."""
import json
import os

import pytest

from loopback_env import ADDR1, HOST_A, port
from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.service.commands import check_config

SUB = "nqn.2024-01.io.test:rbd"


def config(namespaces):
    return {"hosts": [{"nqn": HOST_A}], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "namespaces": namespaces}]}


@pytest.mark.parametrize("rbd, field, words", [
    ({"image": "x"}, "rbd.pool", "is required"),
    ({"pool": "rbd"}, "rbd.image", "is required"),
    ({"pool": "rbd", "image": "a b"}, "rbd.image", "not a RADOS name"),
    ({"pool": "rbd", "image": "x", "conf": "ceph.conf"}, "rbd.conf", "absolute path"),
    ({"pool": "rbd", "image": "x", "create": {"size": "big"}}, "rbd.create.size", "not a size"),
    ({"pool": "rbd", "image": "x", "cache": True}, "rbd.cache", "not a key"),
    ({"pool": "rbd", "image": "x", "native": "yes"}, "rbd.native", "true or false"),
])
def test_a_broken_rbd_setting_is_refused_naming_the_field(rbd, field, words):
    cfg = config([{"nsid": 1, "nvmeof_roce": {"backend": "rbd", "rbd": rbd}}])
    with pytest.raises(ConfigError) as err:
        parse_config(cfg, "t.json")
    assert f"nvmeof_roce.{field}" in str(err.value) and words in str(err.value)


def test_an_rbd_namespace_takes_no_size_and_needs_its_settings():
    for ns, field in (({"backend": "rbd", "size": "1G", "rbd": {"pool": "rbd", "image": "x"}}, "nvmeof_roce.size"),
                      ({"backend": "rbd"}, "nvmeof_roce.rbd")):
        with pytest.raises(ConfigError) as err:
            parse_config(config([{"nsid": 1, "nvmeof_roce": ns}]), "t.json")
        assert field in str(err.value)


def write_config(tmp_path, rbd):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(config([{"nsid": 1, "nvmeof_roce": {"backend": "rbd", "rbd": rbd}}])))
    return str(path)


def test_target_check_says_what_it_cannot_check_without_the_cluster(tmp_path):
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\nmon host = 192.0.2.1:6789\n")  # an address nothing answers on: never asked
    keyring = tmp_path / "client.keyring"
    keyring.write_text("[client.admin]\nkey = AQ==\n")
    os.chmod(keyring, 0o600)
    summary = check_config(write_config(tmp_path, {"pool": "rbd", "image": "x", "conf": str(conf),
                                                   "keyring": str(keyring)}))
    ns = summary["subsystems"][0]["namespaces"][0]
    assert ns["backend"] == "rbd" and "checked when target serve opens it" in ns["note"]


def test_target_check_refuses_a_missing_conf_and_an_open_keyring(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_config(write_config(tmp_path, {"pool": "rbd", "image": "x", "conf": str(tmp_path / "none.conf")}))
    assert "nvmeof_roce.rbd.conf" in str(err.value) and "not a readable file" in str(err.value)
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\n")
    keyring = tmp_path / "k"
    keyring.write_text("[client.admin]\nkey = AQ==\n")
    os.chmod(keyring, 0o644)
    with pytest.raises(ConfigError) as err:
        check_config(write_config(tmp_path, {"pool": "rbd", "image": "x", "conf": str(conf), "keyring": str(keyring)}))
    assert "nvmeof_roce.rbd.keyring" in str(err.value) and "0644" in str(err.value) and "chmod 600" in str(err.value)


def test_the_native_data_path_serves_an_rbd_namespace_unless_it_says_native_false():
    native, reference = parse_config(config([
        {"nsid": 1, "nvmeof_roce": {"backend": "rbd", "rbd": {"pool": "rbd", "image": "a"}}},
        {"nsid": 2, "nvmeof_roce": {"backend": "rbd", "rbd": {"pool": "rbd", "image": "b", "native": False}}}]),
        "t.json").subsystems[0].namespaces
    assert native.backend_settings.native and not reference.backend_settings.native
    assert "native" not in native.backend_settings.to_dict() and reference.backend_settings.to_dict()["native"] is False


def test_rados_names_are_checked_by_one_rule_for_rbd_namespaces_and_gateway_groups():
    from nvmeof_roce.config.errors import ConfigError
    from nvmeof_roce.config.group import parse_group
    from nvmeof_roce.config.rados_names import is_rados_name
    from nvmeof_roce.config.rbd import parse_rbd
    assert is_rados_name("rbd.pool_1+x", 64) and not is_rados_name("-rbd", 64) and not is_rados_name("a b", 64)
    assert is_rados_name("p" * 64, 64) and not is_rados_name("p" * 65, 64) and is_rados_name("p" * 254, 254)
    long_pool = "p" * 65  # too long for a group's pool (64), not for an rbd namespace's (254)
    assert parse_rbd({"pool": long_pool, "image": "i"}, "c.json", "ns").pool == long_pool
    with pytest.raises(ConfigError) as bad:
        parse_group({"name": "g", "gateway": "gw", "ana_groups": [1], "pool": long_pool}, "c.json")
    assert "nvmeof_roce.group.pool" in str(bad.value) and "is not a RADOS name" in str(bad.value)
    with pytest.raises(ConfigError) as bad:
        parse_rbd({"pool": "rbd", "image": "i", "id": ""}, "c.json", "ns")
    assert "ns.id" in str(bad.value)
    assert parse_group({"name": "g", "gateway": "gw", "ana_groups": [1]}, "c.json").namespace == ""


@pytest.mark.parametrize("name", ["gw-a", "g.1", "G_2", "+g", "_g", ".g", "g+1", "-g", "g" * 64])
def test_a_group_or_gateway_name_the_config_takes_is_one_the_groups_records_take(name):
    """`target check` and the gateway's start agree: config/group.py takes a name exactly when the group's records
    (ceph/group/records.py, the object names, omap keys and cookies) do."""
    from nvmeof_roce.ceph.group.errors import GroupError
    from nvmeof_roce.ceph.group.records import check_name
    from nvmeof_roce.config.group import parse_group
    try:
        check_name("gateway", name)
        records_take = True
    except GroupError:
        records_take = False
    for key in ("name", "gateway"):
        settings = {"name": "g", "gateway": "gw", "ana_groups": [1], key: name}
        try:
            parse_group(settings, "c.json")
            config_takes = True
        except ConfigError as exc:
            config_takes = False
            assert key in str(exc)
        assert config_takes == records_take, (key, name)
