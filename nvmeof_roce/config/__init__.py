"""The one target config schema: a superset of nvmetcli's /etc/nvmet/config.json.

Both targets read it: `nvmeof-roce nvmet apply` (the kernel's nvmet through configfs) and
`nvmeof-roce target serve` (the userspace target). The shape is nvmetcli's dump::

    {"hosts": [{"nqn": HOSTNQN}],
     "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                      "trsvcid": "4420", "treq": "not specified"},
                "param": {"inline_data_size": "16384"}, "subsystems": [NQN], "referrals": [],
                "ana_groups": [{"grpid": 1, "ana": {"state": "optimized"}}]}],
     "subsystems": [{"nqn": NQN, "attr": {"allow_any_host": "0", "serial": ..., "model": ...},
                     "allowed_hosts": [HOSTNQN],
                     "namespaces": [{"nsid": 1, "enable": 1, "ana_grpid": 1,
                                     "device": {"path": "/dev/nullb0", "uuid": ..., "nguid": ...}}]}]}

Keys that only the userspace target understands live under ``"nvmeof_roce"`` (on the top
level, a port, a subsystem or a namespace); for example a RAM namespace::

    {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "64M", "block_size": 512}}

The kernel path rejects every ``"nvmeof_roce"`` key (see `userspace_only_keys`). A namespace
without it is a file or block device namespace using ``device.path``.

``to_dict()`` gives the config back in nvmetcli's shape with the generated values (serial,
namespace UUID, ...) filled in; for a file nvmetcli saved it equals the file.

The package, one concern a module: `model` (the schema's vocabulary, value syntax and dataclasses), `loader`
(JSON into the model, every problem named by its JSON path), `userspace` (what the userspace target serves of
it) and `errors`.  The names are re-exported here: `from nvmeof_roce.config import parse_config`.
"""

from .errors import ConfigError, ConfigErrors, raise_all
from .model import (ADRFAMS, ANA_GRPID_MAX, ANA_STATES, BACKENDS, BLOCK_SIZES, CNTLID_MAX, DEFAULT_MODEL,
                    DEFAULT_TRSVCID, DISCOVERY_NQN, MAX_BLOCKS, MAX_INLINE_DATA_SIZE, NQN_MAX_BYTES, NS_IO_ENGINES,
                    NS_QUEUE_DEPTHS, NSID_MAX, PORTID_MAX, QOS_LIMITS, QOS_MAX, TREQS, TRTYPES, USERSPACE_KEY,
                    UUID_RE, WORKER_KEYS, AnaGroupConfig, HostConfig, NamespaceConfig, PortConfig, ReferralConfig,
                    SubsystemConfig, TargetConfig, TargetSettings, host_nqn_problem, namespace_uuid, nqn_problem,
                    parse_cpus, usable_cpus,
                    parse_flag, parse_size, subsystem_nqn_problem, subsystem_serial, userspace_only_keys,
                    validate_host_nqn, validate_nqn, validate_subsystem_nqn)
from .loader import (MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, check_depth, load_config, load_config_collect,
                     parse_config, parse_config_collect, parse_json_text, parse_namespace)
from .userspace import (USERSPACE_FIX, USERSPACE_MAX_NSID, USERSPACE_QUEUE_SIZES, backing_identity,
                        load_userspace_config, namespace_problems, passthru_configured, validate_for_userspace)

__all__ = [
    "ConfigError", "TargetConfig", "PortConfig", "SubsystemConfig", "NamespaceConfig",
    "HostConfig", "ReferralConfig", "AnaGroupConfig", "load_config", "parse_config",
    "parse_size", "validate_nqn", "subsystem_nqn_problem", "userspace_only_keys", "DISCOVERY_NQN", "NSID_MAX",
    "ConfigErrors", "validate_for_userspace", "load_userspace_config", "TargetSettings",
]
