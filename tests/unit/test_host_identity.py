"""Host NQN and host ID derived as libnvme's nvme_host_get_ids / nvmf_hostid_generate do (host_identity.py)."""
import json
import uuid

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.host_identity import Paths, host_identity

NQN_FILE = "nqn.2014-08.org.nvmexpress:uuid:e3e6337d-2b0c-4d0f-afc9-bd8228773684"
PRODUCT = "4c4c4544-0042-3510-8052-b4c04f4e4d32"


def paths(tmp_path, environ=None, **kw):
    d = {"etc_dir": str(tmp_path / "etc"), "product_uuid": str(tmp_path / "product_uuid"),
         "dmi_entries": str(tmp_path / "dmi"), "device_tree_uuid": str(tmp_path / "ibm,partition-uuid")}
    d.update(kw)
    return Paths(environ=environ or {}, **d)


def dmi_entry(tmp_path, name, typ, raw):
    d = tmp_path / "dmi" / name
    d.mkdir(parents=True)
    (d / "type").write_text(f"{typ}\n")
    (d / "raw").write_bytes(raw)


def ident(tmp_path, *args, environ=None, config=None, **kw):
    return host_identity(*args, config_json=str(config) if config else str(tmp_path / "no-config.json"),
                         paths=paths(tmp_path, environ))


def test_machine_uuid_sources_in_libnvmes_order(tmp_path):
    # the SMBIOS type 1 entry: its UUID's first three fields are little endian (DMTF SMBIOS 3.0 §7.2.1)
    dmi_entry(tmp_path, "0-0", 0, bytes(range(40)))
    dmi_entry(tmp_path, "1-0", 1, bytes(8) + bytes(range(16)) + bytes(8))
    (tmp_path / "ibm,partition-uuid").write_bytes(b"11111111-2222-3333-4444-555555555555\0")
    i = ident(tmp_path)
    assert i.hostid == "03020100-0504-0706-0809-0a0b0c0d0e0f" and i.hostnqn == "nqn.2014-08.org.nvmexpress:uuid:" + i.hostid
    assert "hostid: " + str(tmp_path / "dmi") in i.source
    # product_uuid first, as the kernel gives it (a 36-character line)
    (tmp_path / "product_uuid").write_text(PRODUCT + "\n")
    assert ident(tmp_path).hostid == PRODUCT
    # a product_uuid line of another length is not a UUID to libnvme: the next source
    (tmp_path / "product_uuid").write_text(PRODUCT[:-1] + "\n")
    assert ident(tmp_path).hostid == "03020100-0504-0706-0809-0a0b0c0d0e0f"
    # an all-zero SMBIOS UUID is skipped: the device tree's
    (tmp_path / "dmi" / "1-0" / "raw").write_bytes(bytes(40))
    assert ident(tmp_path).hostid == "11111111-2222-3333-4444-555555555555"


def test_random_identity_when_the_machine_has_none_stays_for_the_process(tmp_path):
    a, b = ident(tmp_path), ident(tmp_path)
    assert uuid.UUID(a.hostid).version == 4 and a == b and "hostid: random" in a.source


def test_files_env_and_the_nqn_uuid(tmp_path):
    (tmp_path / "product_uuid").write_text(PRODUCT + "\n")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hostnqn").write_text(NQN_FILE + "\nsecond line\n")
    i = ident(tmp_path)  # no hostid file: the host NQN's UUID, not the machine's
    assert (i.hostnqn, i.hostid) == (NQN_FILE, "e3e6337d-2b0c-4d0f-afc9-bd8228773684")
    (tmp_path / "etc" / "hostid").write_text("77adfae5-a959-4eec-8a09-ad1cef47789e\n")
    assert ident(tmp_path).hostid == "77adfae5-a959-4eec-8a09-ad1cef47789e"
    env = {"LIBNVME_HOSTNQN": "nqn.2024-01.io.example:envhost", "LIBNVME_HOSTID": ""}
    i = ident(tmp_path, environ=env)  # set and empty: no host ID from the environment nor the file
    assert i.hostnqn == "nqn.2024-01.io.example:envhost" and i.hostid == PRODUCT
    i = ident(tmp_path, "nqn.2024-01.io.example:opt", "0b5e0000-0000-4000-8000-0000000000a1")
    assert (i.hostnqn, i.hostid) == ("nqn.2024-01.io.example:opt", "0b5e0000-0000-4000-8000-0000000000a1")


def test_the_json_configs_first_host_comes_before_the_files(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hostnqn").write_text(NQN_FILE + "\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps([{"hostnqn": "nqn.2024-01.io.example:json", "hostid": PRODUCT, "subsystems": []},
                                  {"hostnqn": "nqn.2024-01.io.example:second"}]))
    i = ident(tmp_path, config=config)
    assert (i.hostnqn, i.hostid) == ("nqn.2024-01.io.example:json", PRODUCT) and str(config) in i.source
    config.write_text('{"not": "a list"}')
    with pytest.raises(NvmeofError, match="not a libnvme JSON config"):
        ident(tmp_path, config=config)
    assert host_identity(config_json="none", paths=paths(tmp_path)).hostnqn == NQN_FILE  # -J none


def test_a_host_id_that_is_not_a_uuid_is_refused(tmp_path):
    with pytest.raises(NvmeofError, match="host ID 'nope' \\(from option\\) is not a UUID"):
        ident(tmp_path, None, "nope")
