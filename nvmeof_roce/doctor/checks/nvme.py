"""NVMe-oF: host identity files, firewall rules for RoCE v2 (UDP 4791), target reachability."""
from __future__ import annotations

import re
import shlex
import uuid
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...errors import ToolMissing
from ...nvme.fabrics import NQN_MAX_LENGTH as NQN_MAX_BYTES
from ..context import Context
from ..discovery_probe import discover_with_userspace_initiator
from ..machine import ToolNotRun, missing_tool_reason
from ..result import CheckResult, fail, ok, skipped, warn
from ..tools import ToolFailed, iptables_save, nft_ruleset

ROCE_V2_UDP_PORT = 4791
NQN_FORMAT = re.compile(r"^nqn\.\d{4}-\d{2}\.[^:\s]+:\S+$")
HOSTNQN_FILE = "/etc/nvme/hostnqn"
HOSTID_FILE = "/etc/nvme/hostid"


# --- host identity -------------------------------------------------------------------


def check_host_identity(ctx: Context) -> CheckResult:
    """Detects a missing or malformed host identity (/etc/nvme/hostnqn, /etc/nvme/hostid).
    Without the files nvme-cli and the kernel invent an NQN (the kernel's changes every boot),
    so a target's allowed_hosts entry stops matching and connects are refused ("Connect for
    subsystem ... is not allowed").  hostid should be the UUID inside a uuid-form hostnqn."""
    hostnqn = ctx.machine.read(HOSTNQN_FILE)
    hostid = ctx.machine.read(HOSTID_FILE)
    evidence = [f"{HOSTNQN_FILE}: {hostnqn if hostnqn is not None else 'absent'}",
                f"{HOSTID_FILE}: {hostid if hostid is not None else 'absent'}"]
    details = {"hostnqn": hostnqn, "hostid": hostid}
    fix_create = (f"nvme gen-hostnqn > {HOSTNQN_FILE} && sed 's/.*uuid://' {HOSTNQN_FILE} > {HOSTID_FILE} "
                  "(then add this NQN to the target's allowed_hosts)")
    problems = []
    if not hostnqn:
        problems.append(f"{HOSTNQN_FILE} missing")
    elif not NQN_FORMAT.match(hostnqn) or len(hostnqn.encode()) > NQN_MAX_BYTES:
        return fail("nvme.host_identity", "", f"{HOSTNQN_FILE} is not a valid NQN", evidence,
                    f"an NQN is nqn.YYYY-MM.reverse.domain:name, at most {NQN_MAX_BYTES} bytes: {fix_create}",
                    **details)
    if not hostid:
        problems.append(f"{HOSTID_FILE} missing")
    else:
        try:
            uuid.UUID(hostid)
        except ValueError:
            return fail("nvme.host_identity", "", f"{HOSTID_FILE} is not a UUID", evidence, fix_create, **details)
    if problems:
        return warn("nvme.host_identity", "", "; ".join(problems) + ": NVMe tools will invent a host identity",
                    evidence, fix_create, **details)
    m = re.search(r":uuid:([0-9a-fA-F-]{36})$", hostnqn)
    if m and m.group(1).lower() != hostid.lower():
        return warn("nvme.host_identity", "", "hostid differs from the UUID in hostnqn", evidence,
                    f"sed 's/.*uuid://' {HOSTNQN_FILE} > {HOSTID_FILE} (nvme-cli warns on a mismatch and "
                    "some targets identify hosts by hostid)", **details)
    return ok("nvme.host_identity", "", hostnqn, evidence, **details)


# --- firewall ------------------------------------------------------------------------


@dataclass
class RuleView:
    """One firewall rule, reduced to what matters for UDP 4791 packets."""

    applies: str  # "yes": every RoCE v2 packet matches; "no": none does; "maybe": depends on other fields
    verdict: Optional[str]  # "accept", "drop", "reject", "jump X", or None (counter, log, ...)
    text: str
    mentions_roce: bool


@dataclass
class ChainVerdict:
    chain: str
    outcome: str  # "accepted", "dropped", "undecided"
    by: str  # the rule or "policy drop"
    conditional: List[str]


def _port_in(value, port: int) -> Optional[bool]:
    """Whether an nft right-hand side (int, set, range) contains `port`; None when unknown (named set)."""
    if isinstance(value, int):
        return value == port
    if isinstance(value, str):
        return int(value) == port if value.isdigit() else None
    if isinstance(value, dict):
        if "set" in value:
            found = [_port_in(v, port) for v in value["set"]]
            return True if any(found) else (None if None in found else False)
        if "range" in value:
            low, high = value["range"]
            return int(low) <= port <= int(high)
    if isinstance(value, list):
        return _port_in({"set": value}, port)
    return None


def _nft_render(expr: dict) -> str:
    key, value = next(iter(expr.items()))
    if key != "match":
        return key if value is None else f"{key} {value}" if not isinstance(value, dict) else key
    left, right = value["left"], value["right"]
    if "payload" in left:
        lhs = f"{left['payload'].get('protocol', '')} {left['payload'].get('field', '')}"
    elif "meta" in left:
        lhs = f"meta {left['meta'].get('key')}"
    elif "ct" in left:
        lhs = f"ct {left['ct'].get('key')}"
    else:
        lhs = str(left)
    if isinstance(right, dict) and "set" in right:
        rhs = "{ " + ", ".join(str(v) for v in right["set"]) + " }"
    elif isinstance(right, list):
        rhs = ",".join(map(str, right))
    else:
        rhs = str(right)
    op = "" if value.get("op") in ("==", "in") else f"{value.get('op')} "
    return f"{lhs} {op}{rhs}"


def _nft_match_applies(match: dict) -> Tuple[str, bool]:
    """("yes"|"no"|"maybe", mentions 4791) for one nft match on a RoCE v2 packet (UDP, dport 4791)."""
    left, right, op = match.get("left", {}), match.get("right"), match.get("op", "==")
    negate = op == "!="
    answer, mentions = "maybe", False
    if "payload" in left:
        proto, fld = left["payload"].get("protocol"), left["payload"].get("field")
        if proto in ("udp", "th") and fld == "dport":
            contained = _port_in(right, ROCE_V2_UDP_PORT)
            mentions = bool(contained)
            answer = "maybe" if contained is None else ("yes" if contained != negate else "no")
        elif proto in ("ip", "ip6") and fld in ("protocol", "nexthdr"):
            answer = _protocol_answer(right, negate)
        elif proto not in ("udp", "th", "ip", "ip6", "ether", "vlan"):
            answer = "no"  # a tcp/icmp/sctp header field implies another protocol
    elif "meta" in left and left["meta"].get("key") == "l4proto":
        answer = _protocol_answer(right, negate)
    elif "ct" in left and left["ct"].get("key") == "state":
        states = right if isinstance(right, list) else [right]
        new_flow = any(s in ("new", "untracked") for s in states)
        answer = "yes" if new_flow != negate else "no"  # RoCE v2 replies use other UDP ports: never "established"
    return answer, mentions


def _protocol_answer(right, negate: bool) -> str:
    values = right.get("set", []) if isinstance(right, dict) else right if isinstance(right, list) else [right]
    is_udp = any(v in ("udp", 17, "17") for v in values)
    return "yes" if is_udp != negate else "no"


VERDICT_KEYS = ("accept", "drop", "reject", "jump", "goto", "return", "queue")


def _nft_rule_view(rule: dict) -> RuleView:
    applies, mentions, verdict = "yes", False, None
    parts = []
    for expr in rule.get("expr", []):
        parts.append(_nft_render(expr))
        if "match" in expr:
            answer, mention = _nft_match_applies(expr["match"])
            mentions = mentions or mention
            if answer == "no":
                applies = "no"
            elif answer == "maybe" and applies == "yes":
                applies = "maybe"
        for key in VERDICT_KEYS:
            if key in expr:
                target = expr[key]
                verdict = f"{key} {target.get('target')}" if isinstance(target, dict) and "target" in target else key
    return RuleView(applies, verdict, " ".join(parts), mentions)


def _walk_chain(name: str, rules: List[RuleView], policy: str) -> ChainVerdict:
    """What happens to a new RoCE v2 packet in a base chain: the first rule that surely applies decides."""
    conditional = []
    for rule in rules:
        if rule.applies == "no" or rule.verdict is None:
            continue
        if rule.applies == "maybe":
            if rule.verdict in ("drop", "reject") or rule.mentions_roce:
                conditional.append(f"{rule.text} (only for some packets)")
            continue
        if rule.verdict == "accept":
            return ChainVerdict(name, "accepted", rule.text, conditional)
        if rule.verdict in ("drop", "reject"):
            return ChainVerdict(name, "dropped", rule.text, conditional)
        conditional.append(f"{rule.text} (jumps to another chain: not followed)")
    if policy == "drop":
        return ChainVerdict(name, "dropped", "policy drop, no rule accepts UDP 4791", conditional)
    return ChainVerdict(name, "accepted", f"policy {policy}", conditional)


def nft_roce_verdicts(ruleset: dict) -> List[ChainVerdict]:
    """Verdicts for RoCE v2 in every input/output base chain of an `nft -j list ruleset`."""
    chains, rules = {}, {}
    for item in ruleset.get("nftables", []):
        if "chain" in item:
            c = item["chain"]
            if c.get("hook") in ("input", "output") and c.get("type", "filter") == "filter":
                key = (c["family"], c["table"], c["name"])
                chains[key] = c
                rules[key] = []
        elif "rule" in item:
            r = item["rule"]
            key = (r["family"], r["table"], r["chain"])
            if key in rules:
                rules[key].append(_nft_rule_view(r))
    return [_walk_chain(f"nft {f} {t} {n} (hook {chains[(f, t, n)]['hook']})", rules[(f, t, n)],
                        chains[(f, t, n)].get("policy", "accept")) for (f, t, n) in chains]


def _iptables_rule_view(args: List[str]) -> RuleView:
    """Reduce one `-A CHAIN ...` rule (its arguments after the chain name) to a RuleView."""
    applies, mentions, verdict = "yes", False, None

    def narrow(answer: str):
        nonlocal applies
        if answer == "no":
            applies = "no"
        elif answer == "maybe" and applies == "yes":
            applies = "maybe"

    i, negate = 0, False
    while i < len(args):
        option = args[i]
        i += 1
        if option == "!":
            negate = True
            continue
        if not option.startswith("-"):
            continue
        value = None
        if i < len(args) and args[i] == "!":  # old syntax: -p ! udp
            negate, i = True, i + 1
        if i < len(args) and not args[i].startswith("-"):
            value, i = args[i], i + 1
        if option in ("-j", "--jump", "-g", "--goto"):
            if value in ("ACCEPT", "DROP", "REJECT", "RETURN"):
                verdict = value.lower()
            elif value not in ("LOG", "NFLOG", "MARK", "CONNMARK", "DSCP", "CLASSIFY", "CT"):
                verdict = f"jump {value}"
            break  # what follows are the target's own options
        if option in ("-p", "--protocol"):
            is_udp = value in ("udp", "17", "all")
            narrow("yes" if is_udp != negate else "no")
        elif option in ("--dport", "--destination-port", "--dports", "--destination-ports"):
            contained = any(_iptables_port_in(p, ROCE_V2_UDP_PORT) for p in (value or "").split(","))
            mentions = mentions or contained
            narrow("yes" if contained != negate else "no")
        elif option in ("--state", "--ctstate"):
            new_flow = any(s in ("NEW", "UNTRACKED") for s in (value or "").split(","))
            narrow("yes" if new_flow != negate else "no")
        elif option in ("--syn", "--tcp-flags", "--icmp-type", "--icmpv6-type"):
            narrow("no")  # implies TCP or ICMP
        elif option not in ("-m", "--match", "--comment"):
            narrow("maybe")  # -i, -s, -d, --sport, ...: depends on the packet
        negate = False
    return RuleView(applies, verdict, " ".join(args), mentions)


def _iptables_port_in(spec: str, port: int) -> bool:
    if ":" in spec:
        low, high = spec.split(":", 1)
        return int(low or 0) <= port <= int(high or 65535)
    return spec.isdigit() and int(spec) == port


def iptables_roce_verdicts(text: str) -> List[ChainVerdict]:
    """Verdicts for RoCE v2 in the filter table's INPUT and OUTPUT chains of `iptables-save`."""
    table, policies, rules = None, {}, {"INPUT": [], "OUTPUT": []}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("*"):
            table = line[1:]
        elif table == "filter" and line.startswith(":"):
            name, policy = line[1:].split()[:2]
            policies[name] = policy.lower()
        elif table == "filter" and line.startswith("-A "):
            args = shlex.split(line)
            if args[1] in rules:
                rules[args[1]].append(_iptables_rule_view(args[2:]))
    return [_walk_chain(f"iptables filter {name}", rules[name], policies.get(name, "accept"))
            for name in rules if name in policies]


def check_firewall(ctx: Context) -> CheckResult:
    """Detects host firewall rules (nftables, iptables) that drop RoCE v2: UDP destination port
    4791 carries every RoCE v2 packet, connection setup included.  Soft-RoCE traffic passes
    netfilter, so a drop rule or a drop policy breaks it; hardware RoCE is handled by the NIC
    and bypasses the host firewall, so there it is a warning about the intended policy."""
    evidence, verdicts, reasons = [], [], []
    try:
        found = nft_roce_verdicts(nft_ruleset(ctx.machine))
        verdicts += found
        evidence.append(f"nft -j list ruleset: {len(found)} input/output base chain(s)")
    except (ToolMissing, ToolNotRun) as exc:
        reasons.append(missing_tool_reason(exc))
    except ToolFailed as exc:
        reasons.append(("nft needs root: " if exc.not_permitted else "") + str(exc))
    except ValueError as exc:
        reasons.append(f"nft output not understood: {exc}")
    try:
        found = iptables_roce_verdicts(iptables_save(ctx.machine))
        verdicts += found
        evidence.append(f"iptables-save: {len(found)} filter chain(s)")
    except (ToolMissing, ToolNotRun) as exc:
        reasons.append(missing_tool_reason(exc))
    except ToolFailed as exc:
        reasons.append(("iptables-save needs root: " if exc.not_permitted else "") + str(exc))
    if not evidence:
        return skipped("nvme.firewall", "", "; ".join(reasons))
    evidence += reasons
    for v in verdicts:
        evidence.append(f"{v.chain}: UDP 4791 {v.outcome} by {v.by}")
        evidence += [f"{v.chain}: {c}" for c in v.conditional]
    dropped = [v for v in verdicts if v.outcome == "dropped"]
    details = {"chains": [{"chain": v.chain, "outcome": v.outcome, "by": v.by, "conditional": v.conditional}
                          for v in verdicts]}
    if not dropped:
        summary = "no rule drops UDP 4791 (RoCE v2)" if verdicts else "no firewall rules"
        return ok("nvme.firewall", "", summary, evidence, **details)
    where = "; ".join(f"{v.chain}: {v.by}" for v in dropped)
    fix = ("accept RoCE v2 before the drop: nft insert rule inet filter input udp dport 4791 accept "
           "(and in output if it drops), or iptables -I INPUT -p udp --dport 4791 -j ACCEPT; persist it in "
           "/etc/nftables.conf or the firewall manager (firewall-cmd --add-port=4791/udp --permanent)")
    if ctx.uses_soft_roce:
        return fail("nvme.firewall", "", f"UDP 4791 (RoCE v2) is dropped: {where}", evidence, fix, **details)
    return warn("nvme.firewall", "", f"UDP 4791 (RoCE v2) is dropped by the host firewall: {where} "
                "(hardware RoCE bypasses it; Soft-RoCE would not)", evidence, fix, **details)


# --- target reachability -------------------------------------------------------------


def _describe_entry(entry) -> str:
    subnqn = getattr(entry, "subnqn", None)
    if subnqn is None:
        return str(entry)
    where = ":".join(str(getattr(entry, f)) for f in ("traddr", "trsvcid") if getattr(entry, f, None) is not None)
    return f"{subnqn} at {where}" if where else str(subnqn)


def _connect_failure_fix(error: Exception, ctx: Context) -> str:
    text = f"{type(error).__name__}: {error}".lower()
    target = f"{ctx.traddr}:{ctx.options.trsvcid}"
    causes = []
    status = getattr(error, "status", None)
    if "reject" in text or status is not None:
        causes.append(f"the target refused the connection (CM reject{f' status {status}' if status is not None else ''}): "
                      f"nothing listens on {target} (start it: nvmeof-roce target serve CONFIG, or enable the nvmet "
                      "port), or this host is not allowed (add its NQN to the subsystem's allowed_hosts)")
    if "timed out" in text or "timeout" in text:
        causes.append(f"no answer from {target}: wrong address, the target host is down, or UDP 4791 is dropped on "
                      "the way (nvme.firewall here and on the target, switch ACLs)")
    if "unreachable" in text or "resolv" in text or "address" in text:
        causes.append(f"no RDMA path to {ctx.traddr}: see address.route and address.traddr_gid")
    causes.append(f"check that the target runs and listens on {target} (trtype rdma), the address and port are "
                  "right, UDP 4791 is open on both hosts, and this host's NQN is allowed")
    return "\n".join(dict.fromkeys(causes))


def check_target_reachable(ctx: Context) -> CheckResult:
    """Detects a target that cannot be reached over RDMA: connects to --traddr:--trsvcid with the
    project's userspace initiator (RDMA CM, then an NVMe-oF Fabrics Connect to the discovery
    subsystem) and fetches the discovery log.  This is the end-to-end proof that the fabric,
    addressing and the target all work."""
    if not ctx.traddr:
        return skipped("nvme.target", "", "no --traddr given")
    target = f"{ctx.traddr}:{ctx.options.trsvcid}"
    if not ctx.machine.is_live and ctx.discover is discover_with_userspace_initiator:
        return skipped("nvme.target", target, "not run: --root points at a captured tree, not at this host")
    try:
        entries = ctx.discover(ctx.traddr, ctx.options.trsvcid, ctx.options.connect_timeout, ctx.hostnqn)
    except ImportError as exc:
        return skipped("nvme.target", target, f"userspace initiator unavailable ({exc}); needs pyverbs "
                       "(apt-get install python3-pyverbs)")
    except Exception as exc:  # any transport or protocol error is a failed reachability test
        return fail("nvme.target", target, f"cannot reach {target}: {type(exc).__name__}: {exc}",
                    [f"discovery to {target} with hostnqn {ctx.hostnqn or '(default)'}: {type(exc).__name__}: {exc}"],
                    _connect_failure_fix(exc, ctx), error=str(exc), error_type=type(exc).__name__)
    described = [_describe_entry(e) for e in entries]
    evidence = [f"discovery log from {target}: {len(described)} entr{'y' if len(described) == 1 else 'ies'}"]
    evidence += described
    return ok("nvme.target", target, f"discovery log fetched: {len(described)} entr"
              f"{'y' if len(described) == 1 else 'ies'}", evidence, entries=described)
