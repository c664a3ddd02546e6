"""The package's layers, as they are: which module may import which, and who may read the ASGI `scope`.

Read from the source with `ast` (imports inside functions count too). When the layout changes,
change the two tables: every module of the package sits in exactly one layer of LAYERS, and
MAY_IMPORT says which layers a layer's modules may import from the package.
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
    # Protocol logic, bytes and decoded JSON in and out, no ASGI: the vocabulary and the request
    # side, then the response side and what both share.
    "pure": frozenset({"protocol", "config", "_json", "_optin", "_fields", "nvext_schema", "_client_params",
                       "request", "response", "nvext_values", "stream", "unary", "sse", "_shapes", "metrics"}),
    # What the installed vLLM can do, and its `--api-key` check on the scope.
    "vllm": frozenset({"_vllm_compat"}),
    # The server's ASGI layer: the middleware, its send and receive wrappers (`_speedups`, built from
    # _speedups.c, is the compiled twin of the stream send), the agent routes (`responses_api` reshapes
    # /v1/responses' events, `messages_api` serves /v1/messages in the plugin), the endpoint plugin.
    "asgi": frozenset({"", "middleware", "_asgi_request", "_asgi_response", "_speedups", "responses_api",
                       "messages_api", "plugin"}),
    # Out of process: the middleware in front of a server over HTTP (`vllm-nvext proxy`).
    "proxy": frozenset({"proxy"}),
    # For users, beside the server.
    "beside": frozenset({"client", "hidden_states"}),
    # Engine-side KV connectors: loaded by vLLM's engine process, never by the server.
    "connectors": frozenset({"hidden_states_connector", "pd_connector"}),
    # The tooling (and the old path of vLLM's CLI shim).
    "tools": frozenset({"tools", "tools.*", "_vllm_cli"}),
}
# fmt: on
MAY_IMPORT: dict[str, frozenset[str]] = {
    "pure": frozenset({"pure", "vllm"}),
    "vllm": frozenset(),
    "asgi": frozenset({"asgi", "pure", "vllm"}),
    "proxy": frozenset({"proxy", "asgi", "pure", "vllm"}),
    "beside": frozenset({"beside", "pure"}),
    "connectors": frozenset({"connectors", "beside"}),
    "tools": frozenset({"tools", "pure", "vllm", "beside", "proxy"}),
}
# Only these layers see the ASGI scope (a name `scope`: a parameter or a variable).
READS_SCOPE = frozenset({"asgi", "vllm", "proxy"})


def layer_of(module: str) -> str | None:
    for layer, members in LAYERS.items():
        if module in members or any(m.endswith(".*") and module.startswith(m[:-1]) for m in members):
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
    server = ("pure", "vllm", "asgi")
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
            "request",
            "from .middleware import NvextMiddleware\n",
            "vllm_nvext.request (pure) imports vllm_nvext.middleware (asgi)",
            id="pure-imports-asgi",
        ),
        pytest.param(
            "stream",
            "def f():\n    from .tools import cli\n",
            "vllm_nvext.stream (pure) imports vllm_nvext.tools.cli (tools)",
            id="pure-imports-tools",
        ),
        pytest.param(
            "middleware",
            "import vllm_nvext.pd_connector\n",
            "vllm_nvext.middleware (asgi) imports vllm_nvext.pd_connector (connectors)",
            id="server-imports-connector",
        ),
        pytest.param(
            "response",
            "def f(scope):\n    return 1\n",
            "vllm_nvext.response (pure) reads the ASGI scope",
            id="pure-reads-scope",
        ),
        pytest.param("brand_new", "", "vllm_nvext.brand_new is in no layer: add it to LAYERS", id="unplaced-module"),
    ],
)
def test_a_break_of_the_layers_is_reported(module, source, expected):
    sources = package_sources()
    sources[module] = source
    assert expected in violations(sources)
