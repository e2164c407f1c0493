"""Every tunable is declared once (nvmeof_roce/tunables.py): the config loader, `target serve`'s options, the
resource limits in force and the docs' tables all agree with the declaration."""
import argparse
import re
from pathlib import Path

import pytest

from nvmeof_roce import tunables as T
from nvmeof_roce.cli import build_parser
from nvmeof_roce.config import TargetSettings, parse_config
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.service.worker_configs import config_workers
from nvmeof_roce.transport import resources

REPO = Path(__file__).resolve().parents[2]
SUB = "nqn.2014-08.org.example:tunables"


def _doc_table(heading_line: str) -> dict:
    """{first cell: second cell} of the table following `heading_line` in docs/target.md."""
    lines = (REPO / "docs" / "target.md").read_text().splitlines()
    start = lines.index(heading_line)
    rows, seen_table = {}, False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            seen_table = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] not in ("setting", "option") and not set(cells[0]) <= set("-"):
                rows[cells[0]] = cells[1]
        elif seen_table:
            break
    return rows


def test_the_docs_tables_list_exactly_the_declared_tunables_with_their_defaults():
    settings = _doc_table('Target settings live in the top-level `"nvmeof_roce"` object:')
    assert settings == {f"`{t.name}`": f"{t.default:g}" for t in T.TARGET_SETTINGS.values()}
    options = _doc_table("`target serve --help` lists them.")
    assert options == {f"`{t.option} {t.metavar}`": f"{t.default:g}" for t in T.RESOURCE_LIMITS.values()}


def test_serve_options_are_the_declared_ones_with_their_defaults_and_help():
    parser = build_parser()
    args = parser.parse_args(["target", "serve", "x.json"])
    for t in T.RESOURCE_LIMITS.values():
        assert getattr(args, t.name) == t.default
    given = parser.parse_args(["target", "serve", "x.json", "--mdts", "8", "--connect-timeout", "0.5"])
    assert (given.mdts, given.connect_timeout) == (8, 0.5)
    helps = {a.dest: a.help for a in _subparser(_subparser(parser, "target"), "serve")._actions}
    for t in T.RESOURCE_LIMITS.values():
        assert helps[t.name].startswith(t.help)
    assert helps["workers"] == T.WORKERS.help


def test_the_resource_limits_in_force_take_the_declared_defaults_and_ranges():
    declared = {n: t.default for n, t in T.RESOURCE_LIMITS.items()}
    assert resources.ResourceLimits() == resources.ResourceLimits(**declared)
    assert (resources.DEFAULT_MDTS, resources.MAX_MDTS) == (T.RESOURCE_LIMITS["mdts"].default,
                                                            T.RESOURCE_LIMITS["mdts"].high)
    for name, t in T.RESOURCE_LIMITS.items():
        step = 1 if t.type is int else 0.01
        for ok in (t.low, t.high):
            resources.ResourceLimits(**{name: ok})
        for bad in (t.low - step, t.high + step):
            with pytest.raises(NvmeofError, match=f"{t.option} .*out of range"):
                resources.ResourceLimits(**{name: bad})


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a.choices[name] for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _config(userspace=None, qid_max=None):
    sub = {"nqn": SUB, "attr": {"allow_any_host": "1"}, "namespaces": []}
    if qid_max is not None:
        sub["attr"]["qid_max"] = str(qid_max)
    data = {"hosts": [], "ports": [], "subsystems": [sub]}
    if userspace is not None:
        data["nvmeof_roce"] = userspace
    return data


def test_the_config_takes_the_declared_defaults_and_ranges():
    assert TargetSettings() == TargetSettings(**{n: t.default for n, t in T.TARGET_SETTINGS.items()})
    for name, t in T.TARGET_SETTINGS.items():
        assert getattr(parse_config(_config({name: t.high}), "t").settings, name) == t.high
        assert getattr(parse_config(_config({name: t.low}), "t").settings, name) == t.low
        with pytest.raises(Exception, match=rf"nvmeof_roce\.{name}.*must be {t.low}\.\.{t.high}"):
            parse_config(_config({name: t.high + 1}), "t")
    q = T.QID_MAX
    parse_config(_config(qid_max=q.high), "t")
    with pytest.raises(Exception, match=rf"attr\.qid_max.*must be {q.low}\.\.{q.high}"):
        parse_config(_config(qid_max=q.high + 1), "t")
    w = T.WORKERS
    assert config_workers(parse_config(_config({"workers": w.high}), "t")) == (w.high, None)
    with pytest.raises(Exception, match=rf"must be an integer {w.low}\.\.{w.high}"):
        config_workers(parse_config(_config({"workers": w.high + 1}), "t"))


def test_each_tunable_is_declared_once():
    names = [t.name for t in T.ALL]
    assert len(names) == len(set(names))
    for t in T.ALL:
        assert t.type in (int, float) and t.low <= t.high and t.help
        assert t.default is None or t.in_range(t.default)
        assert re.fullmatch(r"[a-z][a-z_]*", t.name)
