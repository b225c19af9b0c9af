"""`blockspec generate --config FILE.yaml`: a bad file is refused in one line naming the file and the problem (the key,
the line where there is one), never a traceback and never a value silently coerced."""

import pytest

from blockspec.cli import main
from blockspec.config import PredictConfig
from blockspec.errors import BlockspecError


def refused(tmp_path, content: str | bytes) -> str:
    path = tmp_path / "run.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(BlockspecError) as info:
        PredictConfig.from_yaml(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


def loaded(tmp_path, content: str, **overrides) -> PredictConfig:
    path = tmp_path / "run.yaml"
    path.write_text(content)
    return PredictConfig.from_yaml(path, **overrides)


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    message = refused(tmp_path, b"\xff\xfe temperature: 1\n")
    assert "not UTF-8 text (byte 0xff at offset 0)" in message
    assert "offset 14" in refused(tmp_path, b"temperature: 1\xe9\n")


@pytest.mark.parametrize("content, key", [("1: 2\n", "config key 1 "), ("true: 1\n", "config key True "),
                                          ("null: 1\n", "config key None "), ("1.5: x\n", "config key 1.5 ")])
def test_keys_that_are_not_names_are_refused(tmp_path, content, key):
    message = refused(tmp_path, content)
    assert key in message and "is not a setting's name" in message


def test_an_unhashable_key_is_a_yaml_error(tmp_path):
    assert "not valid YAML (found unhashable key at line 1" in refused(tmp_path, "[a]: 3\n")


def test_a_duplicate_key_is_refused_with_its_lines(tmp_path):
    message = refused(tmp_path, "temperature: 0.5\nmax_tokens: 3\ntemperature: 0.7\n")
    assert "key 'temperature' is given twice (line 1, then line 3)" in message
    assert "key 'seed' is given twice" in refused(tmp_path, "{seed: 1, seed: 2}\n")


def test_merged_keys_may_be_overridden(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("<<: {max_tokens: 3, seed: 1}\nmax_tokens: 5\n")
    config = PredictConfig.from_yaml(path)
    assert config.max_tokens == 5 and config.seed == 1


@pytest.mark.parametrize("content, key, problem", [
    ("temperature: true\n", "temperature", "Input should not be true or false (got True)"),
    ("temperature: '0.5'\n", "temperature", "Input should be a valid number (got '0.5')"),
    ("prefix_reuse: 'no'\n", "prefix_reuse", "Input should be true or false (got 'no')"),
    ("prefix_reuse: 1\n", "prefix_reuse", "Input should be true or false (got 1)"),
    ("max_tokens: '1'\n", "max_tokens", "Input should be a valid integer (got '1')"),
    ("max_tokens: 4.0\n", "max_tokens", "Input should be a valid integer (got 4.0)"),
    ("seed: '5'\n", "seed", "(got '5')"),
    ("compile_mode: false\n", "compile_mode", "Input should not be true or false (got False)"),
    ("compile_mode: '0'\n", "compile_mode", "(got '0')"),
    ("draft_vocabulary: true\n", "draft_vocabulary", "Input should not be true or false (got True)"),
    ("draft_vocabulary: 1.5\n", "draft_vocabulary", "(got 1.5)"),
    ("gpu_ranks: [true]\n", "gpu_ranks.0", "(got True)"),
    ("pdl_prefetch_mb: '4'\n", "pdl_prefetch_mb", "(got '4')"),
    ("fold_norms: 'off'\n", "fold_norms", "Input should be true or false (got 'off')"),
    ("temperature: 1:30\n", "temperature", "(got '1:30')"),  # not PyYAML's base-60 ninety
    ("max_tokens: 0x10\n", "max_tokens", "(got '0x10')"),
    ("self_speculative_num_tokens: 16\n", "self_speculative_num_tokens", "less than or equal to 15"),  # 17-row pass
])
def test_values_are_taken_as_written(tmp_path, content, key, problem):
    message = refused(tmp_path, content)
    assert f"invalid value for '{key}': " in message and problem in message, message


@pytest.mark.parametrize("bad", ["temperatur: 0.5", "max_tokens: abc", "seed: true", "gpu_ranks: [0, x]"])
def test_a_refused_key_is_named_with_its_line(tmp_path, bad):
    message = refused(tmp_path, f"# a run\ntemperature: 0.5\n{bad}\nmax_new: 1\n")
    assert "run.yaml line 3: " in message, message


def test_a_merged_key_is_named_with_the_line_it_is_written_on(tmp_path):
    message = refused(tmp_path, "temperature: 0.5\n<<: {seed: 1,\n  max_tokens: x}\n")
    assert message.endswith("run.yaml line 3: invalid value for 'max_tokens': Input should be a valid integer "
                            "(got 'x')"), message


@pytest.mark.parametrize("value", ["'yes'", "1", "sometimes", "[true]"])
def test_load_progress_takes_true_or_false(tmp_path, value):
    message = refused(tmp_path, f"load_progress: {value}\n")
    assert "invalid value for 'load_progress': Input should be true or false" in message, message


def test_well_typed_values_are_accepted(tmp_path):
    config = loaded(tmp_path, "temperature: 1\nmin_p: 1e-3\ntop_p: .5e0\nprefix_reuse: no\nload_progress: true\n"
                              "draft_vocabulary: ids.json\ncompile_mode: -1\ngpu_ranks: [0]\nseed: null\n"
                              "pdl_prefetch_mb: 2\nmax_tokens: 1_000\nprefill_chunk_size: 010\n")
    assert config.temperature == 1.0 and isinstance(config.temperature, float)
    assert config.min_p == 0.001 and config.top_p == 0.5
    assert config.prefix_reuse is False and config.load_progress is True
    assert config.draft_vocabulary == "ids.json" and config.compile_mode == -1 and config.seed is None
    assert config.pdl_prefetch_mb == 2.0 and config.max_tokens == 1000
    assert config.prefill_chunk_size == 10  # decimal, not PyYAML's octal eight


def test_overrides_apply_on_top_of_the_file(tmp_path):
    config = loaded(tmp_path, "temperature: 0.5\nmax_tokens: 3\n", temperature=0.25, draft_vocabulary=7,
                    prefix_reuse=False, load_progress=True, seed=None)
    assert (config.temperature, config.max_tokens, config.draft_vocabulary) == (0.25, 3, 7)
    assert config.prefix_reuse is False and config.load_progress is True


@pytest.mark.parametrize("content", ["", "\n", "# nothing set\n", "---\n", "{}\n"])
def test_an_empty_file_gives_the_defaults(tmp_path, content):
    assert loaded(tmp_path, content) == PredictConfig()


@pytest.mark.parametrize("content, got", [("- temperature: 1\n", "got a list"), ("0\n", "got 0"),
                                          ("false\n", "got False"), ("[]\n", "got a list"),
                                          ("temperature\n", "got 'temperature'")])
def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path, content, got):
    message = refused(tmp_path, content)
    assert "expected a mapping of keys to values" in message and got in message, message


def test_a_syntax_error_names_its_line(tmp_path):
    message = refused(tmp_path, "temperature: 0.5\nseed: [1, 2\n")
    assert "not valid YAML (" in message and "line 3" in message, message


@pytest.mark.parametrize("content, needle", [(b"\xff\xfe temperature: 1\n", "not UTF-8"),
                                             (b"1: 2\n", "config key 1 "),
                                             (b"seed: 1\nseed: 2\n", "line 1, then line 2"),
                                             (b"prefix_reuse: 'no'\n", "'prefix_reuse'"),
                                             (b"- 1\n", "expected a mapping")])
def test_the_command_line_exits_2_in_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    code = main(["generate", "--prompt", "a", "--config", str(path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "bad.yaml" in err and needle in err, err


def test_a_device_a_huge_file_and_deep_nesting_are_refused(tmp_path):
    for device in ("/dev/zero", "/dev/null"):  # read without end, or not a config at all
        with pytest.raises(BlockspecError, match=f"config file {device}: not a regular file"):
            PredictConfig.from_yaml(device)
    assert "nested too deeply" in refused(tmp_path, "a: " + "[" * 5000)
    assert "larger than 1 MB" in refused(tmp_path, "# " + "x" * (1 << 20))
