"""The body vLLM gets is the same whether the compiled root splice or the Python path rewrites it.

`inbound.request.BodyRewrite.apply` hands a body to `_speedups.splice_root` (the root members to drop are
left out, the added ones appended, every other byte kept, values skipped without decoding); the
Python path (`_json.splice_object` over the decoded text) is the oracle and the fallback for what
the compiled one hands back (None: a body that is not plain UTF-8, a key spelled with an escape).
Both twins of `splice_root` (`kernels.Kernels.splice_root`: the compiled one and `_json.splice_root`) run
every test that holds for both. The compiled arm is skipped only where the extension is not built; CI sets
VLLM_NVEXT_REQUIRE_EXTENSION=1 so that a missing build fails instead.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recorded import recordings
from tests.support.kernels import kernels_for
from tests.unit.asgi import Upstream, call
from vllm_nvext import NvextMiddleware, Settings
from vllm_nvext import kernels as kernels_module
from vllm_nvext.config import Mode
from vllm_nvext.inbound import request as request_module
from vllm_nvext.inbound import rewrite as rewrite_module
from vllm_nvext.inbound.request import BodyRewrite, read_request
from vllm_nvext.protocol import PATHS, Endpoint, RequestError

SLOW = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The root members the request side drops or sets, and others.
KEYS = st.sampled_from(
    ["nvext", "return_token_ids", "temperature", "cache_salt", "prompt", "messages", "model", "nvext2", "", "é"]
) | st.text(max_size=4)
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.sampled_from(list('ab"\\/[]{},: \n\u00e9\U0001f600\ud800')), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=10,
)
GAPS = st.sampled_from(["", "", "", " ", "\n", "\t", "\r\n  "])


@pytest.fixture(scope="module")
def splice_root(kernels: kernels_module.Kernels) -> Any:
    """Each twin of the root splice in turn."""
    return kernels.splice_root


@pytest.fixture(scope="module")
def compiled_splice_root() -> Any:
    """The compiled root splice, for what only it does (hand a body back to the Python twin)."""
    return kernels_for("c").splice_root


def _rewrite(drop: set[str], added: dict[str, str]) -> BodyRewrite:
    rewrite = BodyRewrite()
    for key in drop:
        rewrite.drop(key)
    for key, value in added.items():
        rewrite.set(key, value)
    return rewrite


@st.composite
def bodies(draw) -> bytes:
    """A JSON object as a client may write it: duplicate keys, escapes, whitespace in any gap, any encoding."""
    members = []
    for key, value in draw(st.lists(st.tuples(KEYS, VALUES), max_size=7)):
        ascii_only = draw(st.booleans())  # non-ASCII keys and strings as \\u escapes, or as UTF-8
        encoded_key = json.dumps(key, ensure_ascii=ascii_only)
        if key == "nvext" and draw(st.booleans()):
            encoded_key = '"n\\u0076ext"'  # the same key to vLLM
        encoded_value = json.dumps(value, ensure_ascii=ascii_only)
        members.append(f"{draw(GAPS)}{encoded_key}{draw(GAPS)}:{draw(GAPS)}{encoded_value}")
    text = draw(GAPS) + "{" + ",".join(m + draw(GAPS) for m in members) + (draw(GAPS) if not members else "") + "}"
    text += draw(GAPS)
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-32-be"]))
    return text.encode(encoding, "surrogatepass")


@SLOW
@given(
    body=bodies(),
    drop=st.sets(KEYS, max_size=3),
    added=st.dictionaries(st.sampled_from(["return_token_ids", "temperature", "cache_salt"]), st.sampled_from(
        ["true", "0.0", '"s\\ud800"', "[1,2]"]), max_size=2),
)  # fmt: skip
def test_compiled_splice_gives_the_python_paths_bytes(splice_root, body, drop, added):
    rewrite = _rewrite(drop, added)
    expected = rewrite.apply(body)
    assert rewrite.apply(body, splice_root) == expected
    if expected is not None:
        assert json.loads(expected).keys() == {k for k in json.loads(body) if k not in drop | set(added)} | set(
            added
        ), "the members named go, the added ones come, the rest stay"


@SLOW
@given(data=st.binary(max_size=40) | bodies().map(lambda b: b[: len(b) // 2]))
def test_compiled_splice_never_fails_on_bytes_that_are_not_json(compiled_splice_root, data):
    # the request side hands it decoded bodies only; anything else must still be a clean answer
    out = compiled_splice_root(data, (b"nvext",), b'"return_token_ids":true')
    assert out is None or isinstance(out, bytes)


def test_compiled_splice_hands_back_what_the_python_path_decides(compiled_splice_root):
    splice_root = compiled_splice_root
    drop, extra = (b"nvext",), b'"return_token_ids":true'
    assert splice_root('\ufeff{"nvext":1}'.encode("utf-8"), drop, extra) is None  # a BOM
    assert splice_root('{"nvext":1}'.encode("utf-16-le"), drop, extra) is None
    assert splice_root(b'{"n\\u0076ext":1}', drop, extra) is None  # an escaped key
    assert splice_root(b'[{"nvext":1}]', drop, extra) is None  # not an object
    spliced = splice_root(b' {"a" : [1, "]"] ,"nvext":{"x":"}"}}\n', drop, extra)
    assert spliced == b' {"a" : [1, "]"],"return_token_ids":true}\n'
    assert splice_root(b'{"nvext":1}', drop, b"") == b"{}"
    with pytest.raises(TypeError):
        splice_root(b"{}", ("nvext",), b"")


@pytest.mark.parametrize("name", sorted(n for n, r in recordings().items() if r.path in PATHS.values()))
def test_recorded_requests_reach_vllm_as_the_python_path_writes_them(splice_root, name):
    recorded = recordings()[name]
    for variant in (
        {"nvext": {"extra_fields": ["completion_token_ids"]}},
        {"nvext": {"extra_fields": ["timing"], "greed_sampling": True, "cache_salt": "x"}},
    ):
        for indent in (None, 1):
            data = {k: v for k, v in recorded.request.items() if k != "return_token_ids"} | variant
            request = read_request(json.dumps(data, indent=indent).encode(), recorded.endpoint)
            assert request is not None
            try:
                python = request_module.plan(request, Mode.AUTO)
            except RequestError:
                continue  # a selector this recording's request cannot take (a batch, n > 1): refused either way
            compiled = request_module.plan(request, Mode.AUTO, splice_root=splice_root)
            assert compiled.body == python.body and compiled.body is not None


@pytest.mark.parametrize("pure_python", [False, True])
async def test_the_pure_python_setting_keeps_the_request_side_in_python(compiled_splice_root, monkeypatch, pure_python):
    seen: list[bytes] = []

    def recording_splice(body: bytes, drop: tuple[bytes, ...], extra: bytes) -> bytes | None:
        seen.append(body)
        return compiled_splice_root(body, drop, extra)

    compiled = kernels_module.COMPILED
    assert compiled is not None
    monkeypatch.setattr(kernels_module, "COMPILED", replace(compiled, splice_root=recording_splice))
    upstream = Upstream(body=b'{"ok":true}')
    app = NvextMiddleware(upstream, settings=Settings.from_env({}), pure_python=pure_python)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "nvext": {"extra_fields": ["timing"]}}
    result = await call(app, PATHS[Endpoint.CHAT], json.dumps(body).encode())
    assert result.status == 200 and upstream.received is not None, result.body
    assert json.loads(upstream.received) == {"model": "tiny", "messages": body["messages"], "return_token_ids": True}
    assert bool(seen) is not pure_python, "the pure-Python setting reaches the request side"


def test_each_rewrite_splices_its_own_members_when_the_kinds_repeat(splice_root):
    """The compiled splice's arguments are kept per rewrite kind: the same kind again, or the same
    names with other values, splice exactly what the Python path writes."""
    body = b'{"model":"m","nvext":{"cache_salt":"a"},"cache_salt":"x","return_token_ids":false}'
    for salt in ('"a"', '"b"', '"a"', '"\\u00e9"'):
        for drop in ({"nvext"}, {"nvext", "return_token_ids"}, {"nvext"}):
            rewrite = _rewrite(drop, {"cache_salt": salt, "return_token_ids": "true"})
            spliced = rewrite.apply(body, splice_root)
            assert spliced == _rewrite(drop, {"cache_salt": salt, "return_token_ids": "true"}).apply(body)
            assert json.loads(spliced)["cache_salt"] == json.loads(salt)


def test_the_kept_splice_arguments_stay_bounded_whatever_clients_send(splice_root):
    body = b'{"model":"m","nvext":{}}'
    for i in range(300):
        salt = json.dumps(f"salt-{i}")
        spliced = _rewrite({"nvext"}, {"cache_salt": salt}).apply(body, splice_root)
        assert json.loads(spliced) == {"model": "m", "cache_salt": f"salt-{i}"}
    assert len(rewrite_module._SPLICE_ARGS) <= 256
