import os

import pytest

from twinkle.errors import InvalidInputError
from twinkle.server.paths import atomic_child, safe_child


def test_plain_names_join_under_the_root(tmp_path):
    assert safe_child(tmp_path, "alice", "run-x1", "step-10") == tmp_path.resolve() / "alice" / "run-x1" / "step-10"
    assert safe_child(str(tmp_path), "名前 with spaces~") == tmp_path.resolve() / "名前 with spaces~"


@pytest.mark.parametrize(
    ("parts", "problem"),
    [
        (("../x",), "contains a path separator"),
        (("..",), "starts with '.'"),
        ((".",), "starts with '.'"),
        (("/etc",), "contains a path separator"),
        (("a/../../b",), "contains a path separator"),
        (("ok", "..\\..\\x"), "contains a path separator"),
        (("a\x00b",), "contains a NUL character"),
        (("",), "is empty"),
        ((".hidden",), "starts with '.'"),
        (("x" * 256,), "is longer than 255 bytes"),
    ],
)
def test_escaping_names_are_refused(tmp_path, parts, problem):
    with pytest.raises(InvalidInputError, match=f"it {problem}; use a single plain file name"):
        safe_child(tmp_path, *parts)


def test_non_strings_and_no_parts_are_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="must be a string, got int"):
        safe_child(tmp_path, 3)
    with pytest.raises(InvalidInputError, match="at least one name"):
        safe_child(tmp_path)


def test_symlink_escaping_the_root_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "link")
    with pytest.raises(InvalidInputError, match="'link/ckpt' resolves outside its root"):
        safe_child(root, "link", "ckpt")
    os.symlink(root / "alice", root / "inner")  # a link that stays inside is fine
    assert safe_child(root, "inner", "ckpt") == root.resolve() / "alice" / "ckpt"


def test_atomic_child_appears_complete_or_not_at_all(tmp_path):
    with atomic_child(tmp_path, "alice", "ckpt") as tmp:
        (tmp / "weights.bin").write_bytes(b"v1")
        assert not (tmp_path / "alice" / "ckpt").exists()
    assert (tmp_path / "alice" / "ckpt" / "weights.bin").read_bytes() == b"v1"
    with pytest.raises(RuntimeError), atomic_child(tmp_path, "alice", "ckpt") as tmp:
        (tmp / "weights.bin").write_bytes(b"half")
        raise RuntimeError("crash mid-save")
    assert (tmp_path / "alice" / "ckpt" / "weights.bin").read_bytes() == b"v1"
    assert sorted(p.name for p in (tmp_path / "alice").iterdir()) == ["ckpt"]  # no temporary left behind
    with pytest.raises(InvalidInputError), atomic_child(tmp_path, "alice", "../bob"):
        pass
