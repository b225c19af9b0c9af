"""blockspec/files.py: each way a small user file can be wrong, refused in one line naming it."""

import pytest

from blockspec.errors import BlockspecError
from blockspec.files import read_json, read_text


def refused(path, what=None) -> str:
    with pytest.raises(BlockspecError) as exc:
        read_json(path, what)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_each_bad_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "latin1.json").write_bytes(b'["caf\xe9"]')
    (tmp_path / "broken.json").write_text('{\n  "a": 1,\n}')
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert refused("/dev/zero") == "/dev/zero: not a regular file"
    assert refused(tmp_path) == f"{tmp_path}: cannot be read (Is a directory)"
    assert refused(tmp_path / "missing.json", "drafter config") == "drafter config: file not found"
    assert refused(tmp_path / "latin1.json") == f"{tmp_path / 'latin1.json'}: not UTF-8 text (byte 5)"
    assert refused(tmp_path / "broken.json") == \
        f"{tmp_path / 'broken.json'}: not valid JSON (Expecting property name enclosed in double quotes at line 3, column 1)"
    assert refused(tmp_path / "deep.json") == f"{tmp_path / 'deep.json'}: not valid JSON (nested too deeply)"


def test_good_files_are_read(tmp_path):
    (tmp_path / "ok.json").write_text('{"ids": [1, 2]}')
    (tmp_path / "t.jinja").write_text("{{ x }} é")
    assert read_json(tmp_path / "ok.json") == {"ids": [1, 2]}
    assert read_text(str(tmp_path / "t.jinja")) == "{{ x }} é"
