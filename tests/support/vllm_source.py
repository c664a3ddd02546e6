"""What a vLLM release's own source says about a client's `kv_transfer_params` and `request_id`.

Read with `ast` from the release's files (nothing of vLLM is imported), so that every supported
release, installed or in a reference venv, is walked the same way:

- `connector_address_keys`: the keys of `kv_transfer_params` that name where a kv connector
  connects, as its connectors (`distributed/kv_transfer/kv_connector/v1/**`) read them: a string key
  looked up (`[...]`, `.get`, `.pop`, `in`) on `kv_transfer_params` or on a name bound to it, whose
  name says host, port or address. A key read from an object found under a root key (LMCache's
  `kv_transfer_params["disagg_spec"]["receiver_host"]`) counts as that root key.
- `kv_params_routes`: the POST routes whose request model has a `kv_transfer_params` field.
- `renderer_entry`: how the release's `OnlineRenderer` renders chat and /v1/responses: the arguments
  of `preprocess_chat` (the entry capture's render hook wraps) and which renders call it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

CONNECTORS = "distributed/kv_transfer/kv_connector/v1"
_ADDRESS = re.compile(r"(?:^|_)(?:host|hosts|hostname|port|ports|addr|address|addresses|ip|url|endpoint)(?:_|$)")
_ROOT = ""  # the origin of kv_transfer_params itself (else: the root key an object was found under)


def _looked_up(node: ast.AST) -> tuple[ast.expr, str] | None:
    """(object, key) of a lookup of a constant string key: `o["k"]`, `o.get("k")`, `o.pop("k")`, `"k" in o`."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.value, node.slice.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("get", "pop", "setdefault")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.func.value, node.args[0].value
    if (
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Constant)
        and isinstance(node.left.value, str)
        and isinstance(node.ops[0], (ast.In, ast.NotIn))
    ):
        return node.comparators[0], node.left.value
    return None


def _origin(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """Where a value comes from: kv_transfer_params (`_ROOT`), an object under one of its keys, or None."""
    if isinstance(node, ast.Attribute) and node.attr == "kv_transfer_params":
        return _ROOT
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.BoolOp):  # `request.kv_transfer_params or {}`
        return next((o for v in node.values if (o := _origin(v, aliases)) is not None), None)
    if isinstance(node, ast.IfExp):
        return _origin(node.body, aliases) if _origin(node.body, aliases) is not None else _origin(node.orelse, aliases)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in ("dict", "getattr") and node.args:
            if node.func.id == "getattr":  # getattr(request, "kv_transfer_params", None)
                arg = node.args[1] if len(node.args) > 1 else None
                return _ROOT if isinstance(arg, ast.Constant) and arg.value == "kv_transfer_params" else None
            return _origin(node.args[0], aliases)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and len(node.args) > 1:
            # `self._req_kv_params.get(req_id, req.kv_transfer_params or {})`
            return _origin(node.args[1], aliases)
    found = _looked_up(node)
    if found is not None and _origin(found[0], aliases) == _ROOT:
        return found[1]  # an object under a root key
    return None


def _function_keys(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    aliases = {a.arg: _ROOT for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if "kv_transfer_params" in a.arg}
    changed = True
    while changed:  # names bound to kv_transfer_params, or to an object under one of its keys
        changed = False
        for node in ast.walk(function):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                origin = _origin(node.value, aliases)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if origin is not None and isinstance(target, ast.Name) and target.id not in aliases:
                        aliases[target.id] = origin
                        changed = True
    keys = set()
    for node in ast.walk(function):
        found = _looked_up(node)
        if found is None or not _ADDRESS.search(found[1]):
            continue
        origin = _origin(found[0], aliases)
        if origin is not None:
            keys.add(found[1] if origin == _ROOT else origin)
    return keys


def connector_address_keys(vllm_dir: Path) -> dict[str, set[str]]:
    """Each address key of kv_transfer_params that the release's connectors read -> the files reading it."""
    keys: dict[str, set[str]] = {}
    root = vllm_dir / CONNECTORS
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for key in _function_keys(node):
                    keys.setdefault(key, set()).add(str(path.relative_to(root)))
    return keys


def _models_with_kv_params(entrypoints: Path) -> set[str]:
    """The request model classes (by name) with a `kv_transfer_params` field, inherited ones included."""
    bases: dict[str, set[str]] = {}
    direct = set()
    for path in entrypoints.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == "kv_transfer_params":
                        direct.add(node.name)
    models = set(direct)
    while True:
        more = {name for name, parents in bases.items() if parents & models} - models
        if not more:
            return models
        models |= more


def kv_params_routes(vllm_dir: Path) -> set[str]:
    """The POST routes whose body model (the endpoint's `request` parameter) has `kv_transfer_params`."""
    entrypoints = vllm_dir / "entrypoints"
    models = _models_with_kv_params(entrypoints)
    routes = set()
    for path in entrypoints.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            annotations = {a.arg: a.annotation for a in node.args.args}
            model = annotations.get("request")
            if not (isinstance(model, ast.Name) and model.id in models):
                continue
            for decorator in node.decorator_list:
                if (
                    isinstance(decorator, ast.Call)
                    and isinstance(decorator.func, ast.Attribute)
                    and decorator.func.attr == "post"
                    and decorator.args
                    and isinstance(decorator.args[0], ast.Constant)
                    and isinstance(decorator.args[0].value, str)
                ):
                    routes.add(decorator.args[0].value)
    return routes


def renderer_entry(vllm_dir: Path) -> tuple[list[str], set[str]]:
    """(`OnlineRenderer.preprocess_chat`'s first three arguments, the renders of chat and /v1/responses
    that call it) in the release whose package is `vllm_dir` (`renderers/online_renderer.py`)."""
    tree = ast.parse((vllm_dir / "renderers" / "online_renderer.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OnlineRenderer"]
    methods = {n.name: n for n in cls.body if isinstance(n, ast.AsyncFunctionDef)}
    arguments = [a.arg for a in methods["preprocess_chat"].args.args[:3]]
    callers = {
        caller
        for caller in ("render_chat", "render_responses")
        if any(
            getattr(node.func, "attr", None) == "preprocess_chat"
            for node in ast.walk(methods[caller])
            if isinstance(node, ast.Call)
        )
    }
    return arguments, callers
