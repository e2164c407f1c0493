"""The package's shape, as docs/architecture.md and docs/layers.md promise it: every module is named in the
architecture doc, every import follows the layer table of docs/layers.md, and no module imports another in a
circle (all checked on the source, so a lazy import inside a function counts too)."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nvmeof_roce"


def package_modules():
    """Module file paths relative to the package, `__init__.py` files left out."""
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def test_every_module_of_the_package_is_named_in_the_architecture_doc():
    doc = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w/]+\.py)`", doc))
    missing = [m for m in package_modules() if m not in named]
    assert not missing, f"docs/architecture.md's 'Every module' list lacks: {missing}"
    stale = sorted(m for m in named if "/" in m and not (PACKAGE / m).exists() and (PACKAGE / m.split("/")[0]).is_dir())
    assert not stale, f"docs/architecture.md names modules that no longer exist: {stale}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth (functions too), except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph():
    """{module: the package's modules it imports}, from the source of every module of the package."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases = [(a.name, []) for a in node.names]
            else:
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                bases = [(base, [a.name for a in node.names])]
            for base, names in bases:
                subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in files]
                if subs:
                    targets.update(subs)  # `from pkg import module`
                if len(subs) < len(names) or not names:
                    while base and base not in files:  # `import pkg.module.thing`: the module
                        base = base.rpartition(".")[0]
                    if base:
                        targets.add(base)
        graph[name] = {t for t in targets if t != name and t.split(".")[0] == "nvmeof_roce"}
    return graph


def import_circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_of_the_package_imports_another_in_a_circle():
    circles = import_circles(import_graph())
    assert not circles, "modules that import each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle_and_ignores_type_checking_imports():
    # the checker itself, on a graph with one circle of three and one without
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import X\n"
                     "def f():\n    from .y import Y\n")
    assert sorted(n.module for n in _imports(tree)) == ["typing", "y"]


def test_the_engine_imports_nothing_of_the_service_and_the_bench_nothing_of_either():
    graph = import_graph()
    engine_to_service = sorted((m, t) for m, ts in graph.items() if m.startswith("nvmeof_roce.engine")
                               for t in ts if t.startswith("nvmeof_roce.service"))
    assert not engine_to_service, f"the protocol engine imports the daemon: {engine_to_service}"
    # bench.cost measures our own engine and daemon code on the test doubles (run from a checkout, not in the
    # wheel): importing them is its purpose; the `bench` command itself drives the targets through the CLI
    bench_to_daemon = sorted((m, t) for m, ts in graph.items()
                             if m.startswith("nvmeof_roce.bench") and not m.startswith("nvmeof_roce.bench.cost")
                             for t in ts if t.startswith(("nvmeof_roce.service", "nvmeof_roce.engine")))
    assert not bench_to_daemon, f"the bench imports the target's internals (use the CLI): {bench_to_daemon}"


# The layer table: docs/layers.md's fenced `layers` block (its format is described there).

LAYERS_DOC = REPO / "docs" / "layers.md"


class LayerTable:
    """What each layer of the package may import, and the single imports allowed against that."""

    def __init__(self, shared, rules, exceptions):
        self.shared = shared          # {shared module}: every layer may import them; they import only each other
        self.rules = rules            # {layer: {layer or layer.module it may import}}
        self.exceptions = exceptions  # {(importing module, imported module)}, names relative to the package


def parse_layer_table(text: str) -> LayerTable:
    """The table in the first ```layers fenced block of `text`."""
    block = re.search(r"^```layers\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/layers.md has no ```layers block"
    shared, rules, exceptions = set(), {}, set()
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, colon, rest = line.partition(":")
        assert colon, f"docs/layers.md: a line of the layers block is neither `LAYER: ...` nor a comment: {line!r}"
        key = key.strip()
        if key == "shared":
            shared.update(rest.split())
        elif key == "exception":
            importer, arrow, imported = rest.partition("->")
            assert arrow, f"docs/layers.md: an exception is `exception: MODULE -> MODULE`: {line!r}"
            exceptions.add((importer.strip(), imported.strip()))
        else:
            assert key not in rules, f"docs/layers.md: layer {key} has two rows"
            rules[key] = set(rest.split())
    return LayerTable(shared, rules, exceptions)


def _relative(module: str) -> str:
    """`nvmeof_roce.transport.registry` -> `transport.registry`; the package itself -> `__init__`."""
    return module.partition(".")[2] or "__init__"


def layer_of(relative: str, rules=()) -> str:
    """The layer a module belongs to: the most specific row of `rules` naming a package above it (a sub-package
    with a row of its own, such as `bench.cost`), else its top-level package or module (`config.py` and `config/`
    alike)."""
    parts = relative.split(".")
    for i in range(len(parts) - 1, 1, -1):
        if ".".join(parts[:i]) in rules:
            return ".".join(parts[:i])
    return parts[0]


def _covers(name: str, relative: str) -> bool:
    """A table entry (a layer or one module of it) names this module or a package above it."""
    return relative == name or relative.startswith(name + ".")


def cli_command_modules():
    """The modules cli.py imports by name: the strings of its COMMAND_MODULES, which it passes to importlib
    (imports the AST walk cannot see)."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMAND_MODULES" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("nvmeof_roce/cli.py has no COMMAND_MODULES list")


def unknown_names(table: LayerTable, modules):
    """The table's names that match no module or package of `modules` (a typo, or a layer since removed)."""
    known = {_relative(m) for m in modules}
    known |= {".".join(name.split(".")[:i]) for name in known for i in range(1, name.count(".") + 1)}
    named = table.shared | set(table.rules) | {n for names in table.rules.values() for n in names} | \
        {n for pair in table.exceptions for n in pair}
    return sorted(named - known)


def layer_violations(graph, table: LayerTable):
    """One message per import the table does not allow, and one per exception no import uses any more."""
    problems, used_exceptions = [], set()
    for module in sorted(graph):
        importer = _relative(module)
        layer = layer_of(importer, table.rules)
        if layer not in table.shared and layer not in table.rules:
            problems.append(f"{module}: its layer `{layer}` has no row in docs/layers.md")
            continue
        for target in sorted(graph[module]):
            imported = _relative(target)
            if layer_of(imported, table.rules) == layer or layer_of(imported) in table.shared:
                continue
            if layer in table.shared:
                rule = f"shared module `{layer}` may import only the other shared modules"
            elif any(_covers(name, imported) for name in table.rules[layer]):
                continue
            elif table.rules[layer]:
                rule = f"layer `{layer}` may import only {' '.join(sorted(table.rules[layer]))} and the shared modules"
            else:
                rule = f"layer `{layer}` may import only the shared modules"
            if (importer, imported) in table.exceptions:
                used_exceptions.add((importer, imported))
                continue
            problems.append(f"{module} imports {target}, which breaks docs/layers.md's rule: {rule}")
    for importer, imported in sorted(table.exceptions - used_exceptions):
        problems.append(f"docs/layers.md's `exception: {importer} -> {imported}` allows an import the source no "
                        f"longer makes (or one its layer's row allows): remove the line")
    return problems


def test_every_import_of_the_package_follows_the_layer_table_of_docs_layers_md():
    graph = import_graph()
    graph["nvmeof_roce.cli"] = graph["nvmeof_roce.cli"] | cli_command_modules()
    table = parse_layer_table(LAYERS_DOC.read_text())
    unknown = unknown_names(table, graph)
    assert not unknown, f"docs/layers.md names what is no module or package of nvmeof_roce: {unknown}"
    problems = layer_violations(graph, table)
    assert not problems, "\n".join(problems)


def test_the_layer_check_names_the_module_the_import_and_the_rule_it_breaks():
    table = parse_layer_table("```layers\nshared: errors\nnvme:\ntransport: nvme  # a comment\n"
                              "engine: transport.registry\nexception: engine.a -> nvme.x\n"
                              "exception: engine.b -> nvme.y\n```\n")
    assert table.shared == {"errors"} and table.rules["engine"] == {"transport.registry"}
    graph = {
        "nvmeof_roce.transport.base": {"nvmeof_roce.nvme.sgl", "nvmeof_roce.errors", "nvmeof_roce.transport.rdma"},
        "nvmeof_roce.engine.core": {"nvmeof_roce.transport.registry"},
        "nvmeof_roce.engine.queue": {"nvmeof_roce.transport.base"},
        "nvmeof_roce.engine.a": {"nvmeof_roce.nvme.x"},
        "nvmeof_roce.nvme.sgl": {"nvmeof_roce.engine.core"},
        "nvmeof_roce.errors": {"nvmeof_roce.nvme.status"},
        "nvmeof_roce.lab.vm": set(),
    }
    assert layer_violations(graph, table) == [
        "nvmeof_roce.engine.queue imports nvmeof_roce.transport.base, which breaks docs/layers.md's rule: "
        "layer `engine` may import only transport.registry and the shared modules",
        "nvmeof_roce.errors imports nvmeof_roce.nvme.status, which breaks docs/layers.md's rule: "
        "shared module `errors` may import only the other shared modules",
        "nvmeof_roce.lab.vm: its layer `lab` has no row in docs/layers.md",
        "nvmeof_roce.nvme.sgl imports nvmeof_roce.engine.core, which breaks docs/layers.md's rule: "
        "layer `nvme` may import only the shared modules",
        "docs/layers.md's `exception: engine.b -> nvme.y` allows an import the source no longer makes "
        "(or one its layer's row allows): remove the line",
    ]


def test_the_cost_benchmarks_are_left_out_of_the_wheel():
    # they import the test doubles of tests/, which the wheel does not carry
    import tomllib
    from setuptools import find_packages
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ()))
    assert "nvmeof_roce.bench" in packages and "nvmeof_roce.bench.cost" not in packages


# -- the backend seam (docs/architecture.md "The backend seam"): a backend is its Python module
# (engine/backends/<kind>.py), its C file (csrc/be_<kind>.c), and two registry entries: config/backends.py `KINDS`
# and csrc/backend.c `nq_backends[]`.  Nothing else names a kind.
BACKEND_PY = ("engine/backends/", "config/backends.py")
TARGET_ROOMS = ("config/", "engine/", "control/", "service/", "transport/", "systemd/")  # the bench's devices are its own
KIND_BRANCH = re.compile(r"""\b(?:backend|kind)(?:\.kind)?\s*(?:==|!=|\bnot in\b|\bin\b)\s*\(?\s*["'](ram|null|file|block)["']""")
C_ENTRY = re.compile(r"\bnq_backend_(\w+)\b")


def test_no_module_outside_the_backends_and_their_registry_branches_on_a_backend_kind():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(BACKEND_PY) or not rel.startswith(TARGET_ROOMS):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if KIND_BRANCH.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "ask the backend registry (config/backends.py facts) or the backend, not the kind's " \
                          "name:\n" + "\n".join(offenders)


def test_every_registry_entry_names_a_module_of_engine_backends():
    from nvmeof_roce.config.backends import KINDS
    for kind in KINDS.values():
        module, _, cls = kind.implementation.partition(":")
        assert module.startswith("nvmeof_roce.engine.backends.") and cls, kind
        assert (PACKAGE / (module.replace("nvmeof_roce.", "").replace(".", "/") + ".py")).is_file(), kind


def test_each_c_backend_entry_is_its_own_file_and_one_line_of_the_c_registry():
    csrc = REPO / "csrc"
    registry = (csrc / "backend.c").read_text()
    table = registry[registry.index("nq_backends[] = {"):]
    table = table[:table.index("};")]
    listed = set(C_ENTRY.findall(table))
    defined = {}
    for path in sorted(csrc.glob("be_*.c")):
        names = re.findall(r"const struct nq_backend_ops nq_backend_(\w+) = \{", path.read_text())
        assert len(names) == 1, f"{path.name} defines one entry"
        defined[names[0]] = path.name
    assert listed == set(defined), f"csrc/backend.c nq_backends[] lists {sorted(listed)}, csrc/be_*.c define " \
                                   f"{sorted(defined)}"
    # the queue and the rest of the module name no entry and no kind: they call through the table
    for path in sorted(csrc.glob("*.[ch]")):
        if path.name.startswith("be_") or path.name in ("backend.c", "backend.h"):
            continue
        text = path.read_text()
        used = set(C_ENTRY.findall(text)) & set(defined)
        assert not used, f"{path.name} names the backend entries {sorted(used)}"
        assert not re.search(r"\bNQ_(RAM|NULL|FILE)\b|strcmp\(kind", text), f"{path.name} branches on a kind"


# The transport seam (docs/architecture.md "Adding a transport"): a transport is its own package or module under
# transport/ and one entry in transport/registry.py (`BUILT_IN`); the layers above transport/ reach it through the
# registry and transport/contracts.py only, and never name it.

ABOVE_TRANSPORT = ("engine", "control", "service", "config")
# control/methods.py and control/live.py are the control plane's half of issue 46 (their transport settings
# emulation names RDMA): that change removes their "rdma" strings and transport.rdma import, then this goes.
CONTROL_PLANE_NOT_YET: set = set()
TRANSPORTS = ("transport.rdma", "transport.loopback")  # the built-in transports: a package, a module
# Who may import a transport besides its own modules, and why.  A new transport's row is the registry alone.
TRANSPORT_USERS = {
    "transport.registry": "its entry in BUILT_IN",
    "transport.loopback": "the in-process fabric keeps RDMA's rules: its connect checks and SGL kinds",
    "initiator.commands": "the host side: `host connect` opens RDMA host queues",
    "doctor.discovery_probe": "the host side: the doctor's discovery probe over RDMA",
    "bench.cost.native": "the maintainers' cost benchmarks measure the transports from inside",
    "bench.cost.transport": "the maintainers' cost benchmarks measure the transports from inside",
    "bench.cost.initiator": "the maintainers' cost benchmarks measure the transports from inside",
}


def _above_transport(relative: str) -> bool:
    return relative.split(".")[0] in ABOVE_TRANSPORT and relative not in CONTROL_PLANE_NOT_YET


def test_a_transport_is_touched_outside_its_package_by_its_registry_entry_only():
    graph = import_graph()
    users = {}
    for module, targets in graph.items():
        importer = _relative(module)
        for transport in TRANSPORTS:
            if _covers(transport, importer):
                continue
            if any(_covers(transport, _relative(t)) for t in targets):
                users.setdefault(importer, set()).add(transport)
    above = sorted(m for m in users if _above_transport(m))
    assert not above, f"the layers above transport/ import a transport itself (use transport/registry.py): {above}"
    unexplained = sorted(set(users) - set(TRANSPORT_USERS) - CONTROL_PLANE_NOT_YET)
    assert not unexplained, f"modules that import a transport besides its registry entry: {unexplained}"


def _string_constants(source: str, value: str):
    """The lines where `source` has the string constant `value` (any case), f-string parts included."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() == value)


def test_the_layers_above_transport_name_rdma_at_most_three_times():
    # the config's default trtype (config/model.py DEFAULT_TRTYPE) is RDMA: a port without one is served by it
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = _module_name(path).partition(".")[2]
        if _above_transport(relative):
            for line in _string_constants(path.read_text(), "rdma"):
                found.setdefault(str(path.relative_to(PACKAGE)), []).append(line)
    assert sum(map(len, found.values())) <= 3, f'"rdma" above transport/ (ask transport/registry.py): {found}'


def test_the_string_finder_sees_the_string_and_not_a_longer_one_or_a_name():
    # the checker itself
    assert _string_constants('x = "rdma"\ny = f"{x}RDMA"\nz = "use rdma"\nrdma = 1\n', "rdma") == [1, 2]


# The data seam (docs/architecture.md "Adding a transport"): the transport's map_sgl makes a data descriptor of its
# own, which the engine carries unread to read_host and complete, as nvmet's nvmet_req and queue_response.  The
# keyed SGL's address, key and the key a response invalidates are the RDMA transport's (and the loopback
# fabric's, which takes its SGL kinds); the engine names none, nor the SGL's keyed type.  Nor does it know that a
# transport's fast data path is the native C queue (engine/fast_path_view.py, `TargetQueue.fast_path`).
KEYED_SGL_NAMES = {"sgl_addr", "sgl_key", "sgl_id", "invalidate_key", "invalidate", "rkey", "TYPE_KEYED_DATA_BLOCK",
                   "SUBTYPE_ADDRESS", "SUBTYPE_INVALIDATE_KEY", "ID_KEYED", "ID_KEYED_INVALIDATE", "SglDescriptor"}


def keyed_sgl_names(source: str):
    """(line, name) of every name, attribute, argument or import of `source` in KEYED_SGL_NAMES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        found += [(node.lineno, n) for n in names if n in KEYED_SGL_NAMES]
    return sorted(found)


def test_the_engine_carries_the_transports_data_descriptor_unread_and_names_no_keyed_sgl_field():
    found, native = {}, {}
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        source = path.read_text()
        rel = str(path.relative_to(PACKAGE))
        if names := keyed_sgl_names(source):
            found[rel] = names
        if lines := _string_constants(source, "native"):
            native[rel] = lines
    assert not found, f"the engine reads keyed-SGL fields (the transport's map_sgl makes `req.desc`): {found}"
    assert not native, f'the engine names the "native" data path (ask TargetQueue.fast_path): {native}'


def test_the_keyed_sgl_finder_sees_names_attributes_arguments_and_imports():
    # the checker itself
    source = ("from x import SglDescriptor, other\na = req.sgl_key\ndef f(invalidate_key=None): pass\n"
              "g(invalidate=1)\nrkey = 2\nreservation_rkey = 3\n")
    assert keyed_sgl_names(source) == [(1, "SglDescriptor"), (2, "sgl_key"), (3, "invalidate_key"), (4, "invalidate"),
                                       (5, "rkey")]


def test_the_control_plane_touches_the_engine_through_its_api_and_host_settings_and_asks_the_transport_registry():
    """docs/architecture.md "Control plane ⇄ engine": control/ imports engine/api.py (the verbs, mixed into
    Target) and engine/auth.py (host_settings, the keys a reload reads) and nothing else of the engine; of the
    transports it asks only transport/registry.py and reads them through transport/contracts.py (no transport
    module, no `transport.rdma`)."""
    allowed = {"nvmeof_roce.engine.api", "nvmeof_roce.engine.auth", "nvmeof_roce.transport.registry",
               "nvmeof_roce.transport.contracts"}
    reach = sorted((m, t) for m, ts in import_graph().items() if m.startswith("nvmeof_roce.control.") for t in ts
                   if t.startswith(("nvmeof_roce.engine", "nvmeof_roce.transport")) and t not in allowed)
    assert not reach, f"the control plane reaches past the engine's API or the transport registry: {reach}"


# Contracts, not probes (issue 46): the engine, control plane, service and config read declared attributes
# (Protocols in transport/contracts.py, attributes of base classes, argparse defaults, exception classes that
# declare theirs).  What is left are dynamic lookups that are not probes of a contract, each counted here:
# the registries' "module:function" strings (config/loader.py, service/commands.py), the RPC table built from
# Control's rpc_ methods (control/methods.py), the option tables of the resource limits, QoS limits and
# transport port settings (service/serve.py, service/workers.py, control/commands.py, control/rpc/transports.py),
# the native module built with or without io_uring (engine/ioengine.py), a foreign library's errno (engine/
# backends/rbd.py) and the name of any callable in a message (engine/core.py).
PROBE_ROOMS = ("engine", "control", "service", "config")
MOST_DYNAMIC_LOOKUPS = 10


def dynamic_lookups(source: str):
    """The lines of the calls to getattr or hasattr in `source`."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"))


def test_the_engine_control_service_and_config_read_declared_attributes_not_probes():
    found = {}
    for room in PROBE_ROOMS:
        for path in sorted((PACKAGE / room).rglob("*.py")):
            lines = dynamic_lookups(path.read_text())
            if lines:
                found[str(path.relative_to(PACKAGE))] = lines
    count = sum(map(len, found.values()))
    assert count <= MOST_DYNAMIC_LOOKUPS, (f"{count} getattr/hasattr calls in {PROBE_ROOMS} (at most "
                                           f"{MOST_DYNAMIC_LOOKUPS}: declare the attribute instead): {found}")


def test_the_lookup_counter_counts_getattr_and_hasattr_calls_only():
    # the checker itself
    source = 'a = getattr(x, "y", None)\nb = hasattr(x, "y")\nc = x.getattr("y")\ngetattr = 1\nd = setattr(x, "y", 1)\n'
    assert dynamic_lookups(source) == [1, 2]


MOST_MODULE_LINES = 900  # a module over this is more than one room: move a coherent part into a module of its own


def test_no_module_of_the_package_is_over_900_lines():
    long = {m: n for m in package_modules() if (n := len((PACKAGE / m).read_text().splitlines())) > MOST_MODULE_LINES}
    assert not long, f"modules over {MOST_MODULE_LINES} lines (split them by what they do): {long}"


# The native module's C (csrc/): small files, and one-way dependencies between them, as the Python modules above.
CSRC = REPO / "csrc"
C_MAX_LINES = 900
_C_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
# a function defined at file scope, not static: its name, then its parameters and the opening brace
_C_DEFINITION = re.compile(r"^(?!static\b|typedef\b)[A-Za-z_][\w \t*]*?\b(\w+)[ \t]*\([^;{}]*?\)[ \t\n]*\{", re.M)


def _c_code(text: str) -> str:
    """The C text without its comments and string literals (a name in them is no use of it)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def c_dependency_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """{file: the files of `files` it depends on}: its `#include "..."` lines; for a .c file, also the .c file
    whose header (x.h for x.c) it includes and every .c file that defines a (non-static) function it names."""
    defined_in = {}
    for name, text in files.items():
        if name.endswith(".c"):
            for function in _C_DEFINITION.findall(_c_code(text)):
                defined_in.setdefault(function, name)
    graph = {}
    for name, text in files.items():
        deps = {h for h in _C_INCLUDE.findall(text) if h in files}
        if name.endswith(".c"):
            deps |= {h[:-2] + ".c" for h in deps if h.endswith(".h") and h[:-2] + ".c" in files}
            deps |= {defined_in[w] for w in set(re.findall(r"\b\w+\b", _c_code(text))) if w in defined_in}
        graph[name] = deps - {name}
    return graph


def _csrc_files() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(CSRC.glob("*.[ch]"))}


def test_no_c_file_of_the_native_module_is_over_900_lines():
    long = {name: text.count("\n") for name, text in _csrc_files().items() if text.count("\n") > C_MAX_LINES}
    assert not long, (f"csrc/ files over {C_MAX_LINES} lines (split them by concern, docs/architecture.md "
                      f"'Every module'): {long}")


def test_no_c_file_of_the_native_module_depends_on_another_in_a_circle():
    circles = import_circles(c_dependency_graph(_csrc_files()))
    assert not circles, "csrc/ files that depend on each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_the_c_dependency_finder_sees_includes_headers_and_calls():
    files = {
        "a.h": "int a_run(void);\n",
        "a.c": '#include "a.h"\n#include "b.h"\nint a_run(void)\n{\n    return b_count(); /* c_gone() */\n}\n',
        "b.h": "int b_count(void);\n",
        "b.c": '#include "b.h"\nstatic int b_helper(int x) { return x; }\nint b_count(void)\n{\n    return 1;\n}\n',
        "c.c": 'int c_gone(void)\n{\n    return a_run() + (int)sizeof("b_count");\n}\n',
    }
    graph = c_dependency_graph(files)
    assert graph["a.c"] == {"a.h", "b.h", "b.c"}  # b.c: its header, and b_count; not c.c: c_gone is in a comment
    assert graph["b.c"] == {"b.h"}  # b_helper is static: defines nothing for others
    assert graph["c.c"] == {"a.c"}  # a_run; b_count only in a string
    assert import_circles(graph) == []
    files["b.c"] += "int b_more(void)\n{\n    return a_run();\n}\n"
    assert import_circles(c_dependency_graph(files)) == [["a.c", "b.c"]]
