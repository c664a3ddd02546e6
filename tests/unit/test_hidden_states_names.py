"""How the hidden-states connector names and places its files (vllm_nvext.hidden_states).

vLLM takes the request id from the client's `X-Request-Id` header; whatever it holds, the
name `capture_file_name` makes is one plain, bounded file name, and `path_inside` lets no path
leave the storage directory. The real connector is tested on a real server in
tests/e2e/test_hidden_states_hostile.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from vllm_nvext.hidden_states import UnsafePathError, capture_file_name, path_inside

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}-[0-9a-f]{32}\.safetensors")

HOSTILE = {
    "long-300": "L" * 300,
    "long-5000": "chatcmpl-" + "x" * 5000 + "-1a2b3c4d",
    "dotdot": "../../../../../../tmp/x",
    "absolute": "/../../../../tmp/x",
    "through-a-non-directory": "/../../../../dev/null/x",
    "non-ascii": "ä漢字-é-\U0001f600",
    "latin-1-decoded-utf-8": "Ã¤æ¼¢",
    "empty": "",
    "dot": ".",
    "dotdot-alone": "..",
    "control-characters": "a\tb\x01c\x1bd\x7fe\x85f",
    "nul": "a\x00b",
    "lone-surrogate": "a\udc80b",
    "leading-dash": "-rf",
    "dots-and-slashes": "./.././/..//",
    "windows": "..\\..\\C:\\x",
    "lock-suffix": "x.safetensors.lock",
}


@pytest.mark.parametrize("request_id", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_id_gives_a_plain_bounded_name_inside_the_directory(tmp_path, request_id):
    storage = tmp_path / "storage"
    storage.mkdir()
    name = capture_file_name(f"cmpl-{request_id}-0-1a2b3c4d", "salt:0")
    assert NAME.fullmatch(name), name
    assert len(name) <= 109
    path = path_inside(storage, name)
    assert path == str(storage / name)
    # The writer's files are created where the name says, and only there.
    for created in (path, path + ".lock"):
        Path(created).write_bytes(b"x")
    assert sorted(os.listdir(storage)) == sorted([name, name + ".lock"])
    assert sorted(os.listdir(tmp_path)) == ["storage"]


@pytest.mark.parametrize("request_id", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_id_alone_is_a_name_too(request_id):
    assert NAME.fullmatch(capture_file_name(request_id))


def test_the_prefix_keeps_an_ordinary_id_readable():
    name = capture_file_name("chatcmpl-3f2a9c-1a2b3c4d")
    assert name.startswith("chatcmpl-3f2a9c-1a2b3c4d-")
    assert capture_file_name("cmpl-a/b c.d").startswith("cmpl-a_b_c_d-")
    assert capture_file_name("-rf").startswith("rf-"), "never a name that reads as an option"
    assert capture_file_name("").startswith("req-")
    assert capture_file_name("...").startswith("_-")


def test_distinct_ids_give_distinct_names():
    ids = [
        "a/b",
        "a_b",
        "a\x01b",
        "a b",
        "a.b",
        "x" * 64 + "1",
        "x" * 64 + "2",  # the same 64-character prefix
        "ä",
        "Ã¤",
        "",
        ".",
        "..",
    ]
    names = [capture_file_name(i) for i in ids]
    assert len(set(names)) == len(ids)


def test_one_id_with_distinct_salts_gives_distinct_names_and_is_otherwise_stable():
    names = {capture_file_name("same-id", f"engine:{serial}") for serial in range(1000)}
    assert len(names) == 1000
    assert capture_file_name("same-id", "engine:7") == capture_file_name("same-id", "engine:7")
    assert capture_file_name("same-id", "a") != capture_file_name("same-ida", "")


@pytest.mark.parametrize(
    "path",
    [
        "../x.safetensors",
        "sub/../../x.safetensors",
        "/tmp/x.safetensors",
        "/../../../../tmp/x",
        "/../../../../dev/null/x",
        "/dev/null/x",
        "",
        ".",
        "sub/..",
    ],
)
def test_a_path_outside_or_at_the_directory_is_refused(tmp_path, path):
    storage = tmp_path / "storage"
    storage.mkdir()
    with pytest.raises(UnsafePathError, match="is not inside the storage directory"):
        path_inside(storage, path)


def test_an_absolute_path_inside_and_a_relative_one_are_kept(tmp_path):
    assert path_inside(tmp_path, str(tmp_path / "a.safetensors")) == str(tmp_path / "a.safetensors")
    assert path_inside(tmp_path, "sub/b.safetensors") == str(tmp_path / "sub" / "b.safetensors")
    assert path_inside(tmp_path, "sub/../c.safetensors") == str(tmp_path / "c.safetensors")
    assert path_inside(str(tmp_path) + "/", "d") == str(tmp_path / "d")


def test_a_sibling_directory_with_the_same_prefix_is_outside(tmp_path):
    (tmp_path / "hs").mkdir()
    (tmp_path / "hs-other").mkdir()
    with pytest.raises(UnsafePathError):
        path_inside(tmp_path / "hs", "../hs-other/x")


def test_links_are_followed_before_the_check(tmp_path):
    storage, elsewhere = tmp_path / "storage", tmp_path / "elsewhere"
    storage.mkdir()
    elsewhere.mkdir()
    (storage / "out").symlink_to(elsewhere)
    (storage / "file-out").symlink_to(elsewhere / "x.safetensors")
    (storage / "in").symlink_to(storage / "real")
    for path in ("out/x.safetensors", "file-out"):
        with pytest.raises(UnsafePathError, match="is not inside"):
            path_inside(storage, path)
    assert path_inside(storage, "in/x.safetensors") == str(storage / "real" / "x.safetensors")


def test_a_linked_storage_directory_keeps_its_own_spelling(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert path_inside(tmp_path / "link", "x") == str(tmp_path / "link" / "x")
    assert path_inside(tmp_path / "link", str(tmp_path / "real" / "x")) == str(tmp_path / "link" / "x")


@pytest.mark.parametrize("path", [None, 7, ["x"], {"a": 1}, b"x"], ids=repr)
def test_a_path_that_is_not_a_string_is_refused(tmp_path, path):
    with pytest.raises(UnsafePathError, match="must be a string"):
        path_inside(tmp_path, path)


def test_a_path_with_a_nul_is_refused(tmp_path):
    with pytest.raises(UnsafePathError, match="not a usable path"):
        path_inside(tmp_path, "a\x00b")


def test_a_path_the_file_system_cannot_hold_is_refused(tmp_path):
    with pytest.raises(UnsafePathError, match="component is longer"):
        path_inside(tmp_path, "n" * 251)  # 251 + len(".lock") > 255
    assert path_inside(tmp_path, "n" * 250) == str(tmp_path / ("n" * 250))
    with pytest.raises(UnsafePathError, match="path is longer"):
        path_inside(tmp_path, "/".join(["d" * 200] * 21))
