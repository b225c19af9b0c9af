"""check_output_path: the folders it creates to test a place go again, whether the place is good (the writer creates
them when it writes: write_output) or refused; folders that were there before are never removed."""

import errno
import os

import pytest

from blockspec import cli_common
from blockspec.cli_common import check_output_path
from blockspec.errors import BlockspecError

LONG = "x" * (os.pathconf("/", "PC_NAME_MAX") + 1)  # a name no folder can hold (ENAMETOOLONG, root included)


def tree(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_good_path_leaves_no_folder_or_file_until_written(tmp_path):
    path = tmp_path / "a" / "b" / "out.json"
    assert check_output_path("--out", str(path)) == path
    assert tree(tmp_path) == []
    cli_common.write_output(path, "{}")
    assert tree(tmp_path) == ["a", "a/b", "a/b/out.json"] and path.read_text() == "{}"


def test_a_file_that_cannot_be_written_removes_the_folders_made_for_it(tmp_path):
    (tmp_path / "empty").mkdir()  # there before, empty: it stays
    path = tmp_path / "empty" / "a" / "b" / LONG
    with pytest.raises(BlockspecError, match=f"^--out {path}: cannot write there \\(File name too long\\)$"):
        check_output_path("--out", str(path))
    assert tree(tmp_path) == ["empty"]


def test_a_denied_write_removes_the_folders_made_for_it(tmp_path, monkeypatch):
    """As `chmod a-w` on the new file's place would (root ignores that mode, so open is made to fail)."""
    def denied(file, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
    monkeypatch.setattr(cli_common, "open", denied, raising=False)
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    path = tmp_path / "kept" / "new" / "out.json"
    with pytest.raises(BlockspecError, match="cannot write there \\(Permission denied\\)"):
        check_output_path("--out", str(path))
    assert tree(tmp_path) == ["kept", "kept/notes.txt"]


def test_a_folder_that_cannot_be_created_removes_those_created_before_it(tmp_path):
    path = tmp_path / "a" / "b" / LONG / "out.json"
    with pytest.raises(BlockspecError, match=f"^--out {path}: cannot create the folder .*File name too long"):
        check_output_path("--out", str(path))
    assert tree(tmp_path) == []


def test_a_relative_path_in_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BlockspecError, match="cannot write there"):
        check_output_path("--out", os.path.join("new", LONG))
    assert tree(tmp_path) == []
    assert check_output_path("--out", os.path.join("new", "v.json")) and tree(tmp_path) == []


@pytest.mark.parametrize("name", ["existing.txt/", "new/", ""])
def test_a_path_ending_in_a_separator_or_empty_is_refused_and_the_file_kept(tmp_path, name):
    """Path() drops a trailing separator: 'existing.txt/' would be written onto existing.txt."""
    (tmp_path / "existing.txt").write_text("precious")
    path = str(tmp_path / name) + ("/" if name.endswith("/") else "") if name else ""
    with pytest.raises(BlockspecError, match="give a file name \\(the path is empty or ends in a separator\\)"):
        check_output_path("--json-out", path)
    assert tree(tmp_path) == ["existing.txt"] and (tmp_path / "existing.txt").read_text() == "precious"
