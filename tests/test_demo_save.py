"""`blockspec demo --save DIR`: the pair appears in DIR whole or not at all, and a place that cannot be written is
refused in one line naming --save."""

import builtins
import errno
import os
import stat
import zipfile
from pathlib import Path

import pytest

from blockspec.cli import main


def save(capsys, directory, *flags) -> tuple[int, str, str]:
    code = main(["demo", "--save", str(directory), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def fail_after(monkeypatch, members: int, error: BaseException) -> None:
    """Unpacking a member of the zip past the first `members` raises `error` (Ctrl-C, a full disk)."""
    extract = zipfile.ZipFile._extract_member
    done = []

    def extract_member(self, *args, **kwargs):
        if len(done) == members:
            raise error
        done.append(args[0])
        return extract(self, *args, **kwargs)
    monkeypatch.setattr(zipfile.ZipFile, "_extract_member", extract_member)


def make_read_only(monkeypatch, folder: Path) -> None:
    """Nothing can be created or renamed inside folder (chmod a-w; root ignores that mode, so there the calls that
    write are made to fail as the kernel would)."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))  # the fixture gives it back
        return

    def inside(path) -> bool:
        return Path(os.fsdecode(path)).absolute().is_relative_to(folder)

    def denied(path):
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    real_mkdir, real_open, real_rename = os.mkdir, builtins.open, os.rename

    def mkdir(path, *args, **kwargs):
        if inside(path) and Path(os.fsdecode(path)).absolute() != folder:
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(path))
            raise denied(path)
        return real_mkdir(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and inside(file) and set(mode) & set("wax+"):
            raise denied(file)
        return real_open(file, mode, *args, **kwargs)

    def rename(source, destination, *args, **kwargs):
        if inside(source) or inside(destination):
            raise denied(destination)
        return real_rename(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(builtins, "open", open_)


@pytest.fixture
def read_only(monkeypatch):
    folders = []

    def apply(folder):
        folders.append((folder, folder.stat().st_mode))
        make_read_only(monkeypatch, folder)
    yield apply
    for folder, mode in folders:
        folder.chmod(mode)


def test_save_writes_the_pair_and_nothing_beside_it(tmp_path, capsys):
    directory = tmp_path / "new" / "pair"
    code, out, err = save(capsys, directory)
    assert code == 0, err
    assert (directory / "target" / "config.json").is_file() and (directory / "drafter" / "config.json").is_file()
    assert (directory / "target" / "model.safetensors").stat().st_size > 0
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["pair"]  # no unpacking folder left beside it
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask  # a folder like any new one, not private


def test_save_into_an_existing_empty_folder_keeps_the_folder(tmp_path, monkeypatch, capsys):
    """The folder itself stays (its mode, and a shell inside it: `cd pair && blockspec demo --save .`)."""
    directory = tmp_path / "pair"
    directory.mkdir()
    directory.chmod(0o750)
    inode = directory.stat().st_ino
    monkeypatch.chdir(directory)
    code, out, err = save(capsys, ".")
    assert code == 0, err
    assert sorted(p.name for p in Path(".").iterdir()) == ["drafter", "target"]  # seen from the same folder
    assert directory.stat().st_ino == inode and stat.S_IMODE(directory.stat().st_mode) == 0o750
    assert [p.name for p in tmp_path.iterdir()] == ["pair"]


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "existing empty folder"])
@pytest.mark.parametrize("members", [0, 3, 10])
def test_an_interrupted_save_leaves_nothing_behind(tmp_path, monkeypatch, capsys, existing, members):
    """Ctrl-C while the zip unpacks: DIR is as before (absent, or empty), with no partial pair anywhere, nor the
    folders made for it."""
    directory = tmp_path / "made" / "for" / "pair"
    if existing:
        directory.mkdir(parents=True)
    fail_after(monkeypatch, members, KeyboardInterrupt())
    code, out, err = save(capsys, directory)
    assert code == 130
    if existing:
        assert directory.is_dir() and list(directory.iterdir()) == []
        assert list(directory.parent.iterdir()) == [directory]
    else:
        assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_naming_the_destination(tmp_path, monkeypatch, capsys):
    directory = tmp_path / "pair"
    fail_after(monkeypatch, 5, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    code, out, err = save(capsys, directory)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"--save {directory}: " in err and "No space left on device" in err and "demo_pair.zip" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "existing empty folder"])
def test_a_read_only_place_is_refused_before_unpacking(tmp_path, monkeypatch, capsys, read_only, existing):
    """A folder that cannot be written: one line naming --save and why, before a member is unpacked."""
    place = tmp_path / "place"
    directory = place / "pair"
    directory.mkdir(parents=True) if existing else place.mkdir()
    read_only(directory if existing else place)
    fail_after(monkeypatch, 0, AssertionError("unpacking started before the destination was checked"))
    code, out, err = save(capsys, directory)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"blockspec: error: --save {directory}: ") and "ermission denied" in err, err
    assert "demo_pair.zip" not in err
    assert list(place.iterdir()) == ([directory] if existing else [])


def test_a_refused_save_keeps_what_the_folder_holds(tmp_path, capsys):
    directory = tmp_path / "pair"
    (directory / "target").mkdir(parents=True)
    (directory / "target" / "mine.txt").write_text("mine")
    code, out, err = save(capsys, directory)
    assert code == 2 and "the folder is not empty" in err, err
    assert [p.name for p in directory.rglob("*")] == ["target", "mine.txt"]
    assert (directory / "target" / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "600", "--context-length", "512"], "--max-tokens 600 is not below --context-length 512"),
    (["--max-tokens", "5000"], "--max-tokens 5000: the demo's target holds 4096 positions"),
    (["--context-length", "9000"], "--context-length 9000: the demo's target holds 4096 positions"),
])
def test_settings_the_saved_commands_would_refuse_are_refused_leaving_nothing(tmp_path, capsys, flags, message):
    for existing in (False, True):
        directory = tmp_path / f"pair{existing}"
        if existing:
            directory.mkdir()
        code, out, err = save(capsys, directory, *flags)
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert (list(directory.iterdir()) == []) if existing else not directory.exists()
        assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
