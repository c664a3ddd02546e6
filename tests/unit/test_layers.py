"""The package's layers, as they are: which module may import which, and who may read the ASGI `scope`.

Read from the source with `ast` (imports inside functions count too). When the layout changes,
change the two tables: every module of the package sits in exactly one layer of LAYERS, and
MAY_IMPORT says which layers a layer's modules may import from the package. A module named in a
layer belongs to it even inside a folder another layer claims with `.*` (the Plan, `inbound.plan`).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_nvext"

# Module names relative to the package ("" is the package itself, "tools.*" every tools module).
# fmt: off
LAYERS: dict[str, frozenset[str]] = {
    # What every side shares: the vocabulary (paths, selectors, errors), settings, JSON that never
    # alters a value, the Plan that the request side makes (inbound/plan.py, beside its maker) and hands
    # the response side, the ASGI interface's types (asgi_types); config also holds the bound on what is
    # kept per distinct input.
    "base": frozenset({"protocol", "config", "_json", "inbound.plan", "asgi_types"}),
    # Reading a request and planning it (pure, no ASGI).
    "inbound": frozenset({"inbound", "inbound.*"}),
    # Reshaping an answer, unary or streamed, driven by the Plan (pure, no ASGI); its SSE framer
    # (outbound/sse.py) reads every streamed answer: the client's, the agent routes' and the capture tap's too.
    "outbound": frozenset({"outbound", "outbound.*"}),
    # What the installed vLLM can do, and its `--api-key` check on the scope.
    "vllm": frozenset({"_vllm_compat"}),
    # The server's ASGI layer: the middleware (its route; middleware/exchange.py: one request's cycle), its
    # receive and send plumbing (`asgi`, `send`; `kernels` picks the compiled twins of `_speedups`, built from
    # csrc/, or their Python ones), the counters, the agent routes, the endpoint plugin.
    "asgi": frozenset(
        {"", "middleware", "middleware.*", "asgi", "send", "kernels", "_speedups", "metrics", "agent", "agent.*",
         "plugin"}
    ),
    # Out of process: the middleware in front of a server over HTTP (`vllm-nvext proxy`).
    "proxy": frozenset({"proxy", "proxy.*"}),
    # For users, beside the server.
    "beside": frozenset({"client", "hidden_states"}),
    # Engine-side KV connectors (and their first import paths): loaded by vLLM's engine process, never
    # by the server.
    "connectors": frozenset({"connectors", "connectors.*", "hidden_states_connector", "pd_connector"}),
    # Capture of token-id trajectories by session: the Turn record, the session keys, the store (SQLite,
    # Redis) and the read API's answers (no ASGI scope: the middleware and the proxy wire them).
    "capture": frozenset({"capture", "capture.*"}),
    # The tooling (and the old path of vLLM's CLI shim).
    "tools": frozenset({"tools", "tools.*", "_vllm_cli"}),
}
# fmt: on
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset({"base"}),
    "inbound": frozenset({"inbound", "base", "vllm"}),
    "outbound": frozenset({"outbound", "base"}),
    "vllm": frozenset({"base"}),
    "asgi": frozenset({"asgi", "inbound", "outbound", "base", "vllm", "capture"}),
    "proxy": frozenset({"proxy", "asgi", "base", "vllm", "capture"}),
    "beside": frozenset({"beside", "outbound", "base"}),
    "connectors": frozenset({"connectors", "beside"}),
    "tools": frozenset({"tools", "inbound", "outbound", "base", "vllm", "beside", "proxy", "capture"}),
    # The tap frames a streamed answer with the response side's SSE framer.
    "capture": frozenset({"capture", "inbound", "outbound", "base"}),
}
# Only these layers see the ASGI scope (a name `scope`: a parameter or a variable).
READS_SCOPE = frozenset({"asgi", "vllm", "proxy"})


def layer_of(module: str) -> str | None:
    """The layer that names `module`, else the one whose folder (`name.*`) holds it."""
    for layer, members in LAYERS.items():
        if module in members:
            return layer
    for layer, members in LAYERS.items():
        if any(m.endswith(".*") and module.startswith(m[:-1]) for m in members):
            return layer
    return None


def package_sources() -> dict[str, str]:
    """Every module of the package, by its name relative to the package, with its source."""
    sources = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources


def imported_modules(module: str, source: str, known: set[str]) -> set[str]:
    """The package's modules `module` imports (relative to the package), wherever in the file."""
    is_package = module == "" or f"{module}.__init__" in known or any(k.startswith(module + ".") for k in known)
    here = module.split(".") if module else []
    if not is_package:
        here = here[:-1]
    found: set[str] = set()

    def add(name: str, names: list[str]) -> None:
        # `from x import y`: y is a module when the package has one by that name, else a name in x.
        for alias in names:
            sub = f"{name}.{alias}" if name else alias
            found.add(sub if sub in known else name)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm_nvext" or alias.name.startswith("vllm_nvext."):
                    found.add(alias.name.removeprefix("vllm_nvext").removeprefix("."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "vllm_nvext" or node.module.startswith("vllm_nvext.")):
                name = node.module.removeprefix("vllm_nvext").removeprefix(".")
            else:
                continue
            add(name, [a.name for a in node.names])
    found.discard(module)
    return found


def reads_scope(source: str) -> bool:
    return any(
        (isinstance(node, ast.Name) and node.id == "scope") or (isinstance(node, ast.arg) and node.arg == "scope")
        for node in ast.walk(ast.parse(source))
    )


def violations(sources: Mapping[str, str]) -> list[str]:
    """Every break of the tables, one line each; [] when the package keeps its layers."""
    known = set(sources)
    out = []
    for module, source in sources.items():
        layer = layer_of(module)
        if layer is None:
            out.append(f"vllm_nvext.{module or '__init__'} is in no layer: add it to LAYERS")
            continue
        for target in sorted(imported_modules(module, source, known)):
            target_layer = layer_of(target)
            if target_layer not in MAY_IMPORT[layer]:
                out.append(f"vllm_nvext.{module} ({layer}) imports vllm_nvext.{target} ({target_layer})")
        if layer not in READS_SCOPE and reads_scope(source):
            out.append(f"vllm_nvext.{module} ({layer}) reads the ASGI scope")
    return out


def test_the_package_keeps_its_layers():
    assert violations(package_sources()) == []


def test_the_server_never_imports_the_tools_or_the_connectors():
    server = ("base", "inbound", "outbound", "vllm", "asgi", "capture")
    for layer in server:
        assert not MAY_IMPORT[layer] & {"tools", "connectors"}, layer
    assert not any("connectors" in allowed for layer, allowed in MAY_IMPORT.items() if layer != "connectors")


def test_the_import_reader_sees_every_form_of_import():
    known = {"", "protocol", "request", "middleware", "tools", "tools.cli", "tools.server"}
    source = (
        "from . import protocol\n"
        "from .request import Plan\n"
        "import vllm_nvext.middleware\n"
        "def later():\n"
        "    from vllm_nvext.tools import server\n"
    )
    assert imported_modules("tools.cli", "from . import server\nfrom ..protocol import Endpoint\n", known) == {
        "tools.server",
        "protocol",
    }
    assert imported_modules("request", source, known) == {"protocol", "middleware", "tools.server"}


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        pytest.param(
            "inbound.request",
            "from ..middleware import NvextMiddleware\n",
            "vllm_nvext.inbound.request (inbound) imports vllm_nvext.middleware (asgi)",
            id="request-side-imports-asgi",
        ),
        pytest.param(
            "outbound.stream",
            "from ..inbound.request import read_request\n",
            "vllm_nvext.outbound.stream (outbound) imports vllm_nvext.inbound.request (inbound)",
            id="response-side-imports-request-side",
        ),
        pytest.param(
            "inbound.fields",
            "from ..outbound import chunks\n",
            "vllm_nvext.inbound.fields (inbound) imports vllm_nvext.outbound.chunks (outbound)",
            id="request-side-imports-response-side",
        ),
        pytest.param(
            "outbound.stream",
            "def f():\n    from ..tools import cli\n",
            "vllm_nvext.outbound.stream (outbound) imports vllm_nvext.tools.cli (tools)",
            id="response-side-imports-tools",
        ),
        pytest.param(
            "middleware",
            "import vllm_nvext.connectors.pd\n",
            "vllm_nvext.middleware (asgi) imports vllm_nvext.connectors.pd (connectors)",
            id="server-imports-connector",
        ),
        pytest.param(
            "outbound.chunks",
            "def f(scope):\n    return 1\n",
            "vllm_nvext.outbound.chunks (outbound) reads the ASGI scope",
            id="response-side-reads-scope",
        ),
        pytest.param("brand_new", "", "vllm_nvext.brand_new is in no layer: add it to LAYERS", id="unplaced-module"),
    ],
)
def test_a_break_of_the_layers_is_reported(module, source, expected):
    sources = package_sources()
    sources[module] = source
    assert expected in violations(sources)


def circles(sources: Mapping[str, str]) -> list[list[str]]:
    """The package's import circles (modules that import each other, through others or straight; imports inside
    functions and under TYPE_CHECKING count), each sorted, smallest module name first; [] when there is none."""
    known = set(sources) | {"_speedups"}  # the compiled module: `from . import _speedups` imports it, not the package
    graph = {
        module: sorted(imported_modules(module, source, known) & set(sources)) for module, source in sources.items()
    }
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(found)


# The hot path: what every streamed event and every answer runs through, capture on or off.
HOT_PATH = ("kernels", "send", "outbound.*")


def reached(sources: Mapping[str, str], start: str) -> set[str]:
    """Every module of the package that importing `start` imports, through others too (`start` included)."""
    known = set(sources) | {"_speedups"}
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in sources:
            continue
        seen.add(module)
        todo += imported_modules(module, sources[module], known)
    return seen


def test_no_hot_path_module_imports_the_capture_even_for_its_types():
    """The reshaping `send`, the kernels and the response side pass messages on: they name the ASGI types
    (asgi_types), never the plumbing that opens a store, so loading or type-checking them loads no capture."""
    sources = package_sources()
    hot = [m for m in sources if any(m == p or (p.endswith(".*") and m.startswith(p[:-1])) for p in HOT_PATH)]
    assert "send" in hot and "kernels" in hot and "outbound.stream" in hot
    assert {m: sorted(c for c in reached(sources, m) if layer_of(c) == "capture") for m in hot} == {m: [] for m in hot}
    sources["send"] += "from .middleware import capture\n"
    assert "capture.store" in reached(sources, "send"), "the check sees an import through others"


def test_no_module_imports_itself_through_others():
    """Each module reads as the ones below it: a circle (the request side's reading and its helpers, the capture
    store and its backends, as they were) means neither half can be read, tested or moved alone."""
    assert circles(package_sources()) == []


def test_a_circle_is_reported_with_its_modules():
    sources = package_sources()
    sources["capture.base"] += "from .sqlite_store import SQLiteBackend\n"
    sources["brand_new"] = "def f():\n    from .inbound import fields\n"
    sources["inbound.fields"] += "if TYPE_CHECKING:\n    from ..brand_new import f\n"
    assert circles(sources) == [["brand_new", "inbound.fields"], ["capture.base", "capture.sqlite_store"]]


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("vllm_nvext.hidden_states_connector", "vllm_nvext.connectors.hidden_states", "CPUHiddenStatesConnector"),
        ("vllm_nvext.pd_connector", "vllm_nvext.connectors.pd", "CPUPDConnector"),
    ],
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's and vLLM's own imports warn
def test_a_kv_connector_module_path_of_the_first_layout_still_loads_the_connector(old, new, name):
    """`kv_connector_module_path` values users wrote before the connectors moved keep working."""
    import importlib

    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def _uses_sys_path(source: str) -> bool:
    return any(
        isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
        for node in ast.walk(ast.parse(source))
    )  # fmt: skip


def test_no_code_of_the_repository_changes_sys_path():
    """Tests, scripts, benchmarks and examples import the package and each other from the repository
    root as packages (`python -m scripts.record_fixtures`); none reaches for `sys.path`."""
    root = PACKAGE.parent
    folders = ("vllm_nvext", "tests", "scripts", "benchmarks", "examples")
    sources = [path for folder in folders for path in (root / folder).rglob("*.py")]
    assert len(sources) > 100
    assert [str(p.relative_to(root)) for p in sources if _uses_sys_path(p.read_text())] == []
    assert _uses_sys_path("import sys\nsys.path.insert(0, 'x')\n"), "the check sees a change"


# The layout's ceilings (CONTRIBUTING.md "Layout") and the margins kept under them: a module, a function or the
# package's top within 10% of a ceiling needs a seam before it grows, so the test holds the margins (with room:
# 16 of 20 top-level modules, 400 of 450 lines, 52 of 60).
TOP_MODULES_HELD, MODULE_LINES_HELD, FUNCTION_LINES_HELD = 16, 400, 52  # the ceilings: 20, 450, 60
# Modules and functions past the margin but within the ceilings (450 lines, 60), each to be cut along its seams,
# then removed from here.
MODULE_LINES, FUNCTION_LINES = 450, 60
OVER_THE_MARGIN: frozenset[str] = frozenset()


def test_the_package_stays_easy_to_read():
    """The layout's limits (CONTRIBUTING.md "Layout"), with room to spare: at most 16 modules at the top of the
    package (20 the ceiling), no module over 400 lines (450), no function of the server over 52 lines (60; the
    tools are scripts, not counted)."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py")) + sorted(p.name for p in PACKAGE.glob("*.c"))
    assert len(top) <= TOP_MODULES_HELD, top
    too_long = []
    for module, source in package_sources().items():
        lines = source.count("\n")
        if lines > (MODULE_LINES if module in OVER_THE_MARGIN else MODULE_LINES_HELD):
            too_long.append(f"vllm_nvext.{module or '__init__'}: {lines} lines")
        if layer_of(module) == "tools":
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                held = FUNCTION_LINES if f"{module}.{node.name}" in OVER_THE_MARGIN else FUNCTION_LINES_HELD
                if length > held:
                    too_long.append(f"vllm_nvext.{module}.{node.name}: {length} lines")
    assert too_long == []
