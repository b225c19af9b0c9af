"""A setting given by name that does nothing in the run is named on stderr (a note, not an error); defaults never
are."""

import pytest

from blockspec.config import PredictConfig, unused_settings

DRAFTER = {"dflash2_model": "drafter"}  # mode None reads as dflash2 with a drafter


@pytest.mark.parametrize("given, key, why", [
    ({"dflash2_tree_scores": "marginal"}, "dflash2_tree_scores", "mode is 'none'"),
    ({"mode": "mtp", "dflash2_tree_scores": "marginal"}, "dflash2_tree_scores", "mode is 'mtp'"),
    ({**DRAFTER, "dflash2_tree_budget": 0, "dflash2_tree_scores": "marginal"}, "dflash2_tree_scores",
     "dflash2_tree_budget is 0"),
    ({"mode": "none", "dflash2_tree_budget": 0}, "dflash2_tree_budget", "mode is 'none'"),
    ({"mode": "mtp", "dflash2_tree_lookup": 0}, "dflash2_tree_lookup", "mode is 'mtp'"),
    ({**DRAFTER, "dflash2_tree_budget": 0, "dflash2_tree_lookup": 0}, "dflash2_tree_lookup",
     "dflash2_tree_budget is 0"),
    ({"draft_vocabulary": 100}, "draft_vocabulary", "mode is 'none'"),
    ({"prefix_reuse": False, "prefix_snapshots": 8}, "prefix_snapshots", "prefix_reuse is false"),
    ({"self_speculative_num_tokens": 5}, "self_speculative_num_tokens", "mode is 'none'"),
    ({**DRAFTER, "self_speculative_num_tokens": 5}, "self_speculative_num_tokens", "mode is 'dflash2'"),
    ({"device": "cpu", "pdl_level": 3}, "pdl_level", "device is 'cpu'"),
    ({"device": "cpu", "pdl_prefetch_mb": 2.0}, "pdl_prefetch_mb", "device is 'cpu'"),
    ({"pdl_level": 0, "pdl_prefetch_mb": 2.0}, "pdl_prefetch_mb", "pdl_level is 0"),
    ({"device": "cpu", "gpu_ranks": [1]}, "gpu_ranks", "device is 'cpu'"),
    ({"device": "cpu", "compile_mode": -1}, "compile_mode", "the CPU always runs eagerly"),
])
def test_a_given_setting_that_does_nothing_is_named(given, key, why):
    notes = unused_settings(PredictConfig(**given))
    assert len(notes) == 1 and notes[0].startswith(f"{key}: ") and why in notes[0], notes
    assert "\n" not in notes[0]


@pytest.mark.parametrize("given", [
    {},
    {"prefix_reuse": False},                                # prefix_snapshots left at its default
    {"mode": "none"},
    {**DRAFTER, "dflash2_tree_scores": "marginal", "dflash2_block_size": 4, "dflash2_quantization": "int8"},
    {**DRAFTER, "dflash2_tree_lookup": 0},                 # a tree without its branch: read
    {"mode": "mtp", "self_speculative_num_tokens": 5, "draft_vocabulary": 100},
    {"prefix_reuse": True, "prefix_snapshots": 8},
    {"pdl_level": 3, "pdl_prefetch_mb": 2.0, "gpu_ranks": [0]},  # device auto may be a GPU
    {"device": "cuda", "pdl_level": 3, "compile_mode": -1},
    {"device": "cpu", "compile_mode": 0},                   # refused when the engine loads, not noted
    # given at their defaults: nothing asked for goes unread (other values of these two are refused at load)
    {"mode": "mtp", "dflash2_block_size": None, "dflash2_quantization": "none", "draft_vocabulary": 0},
    {"device": "cpu", "gpu_ranks": [0], "dflash2_tree_scores": "transition"},
])
def test_settings_that_take_effect_or_were_not_given_are_not_named(given):
    assert unused_settings(PredictConfig(**given)) == []


def test_keys_from_a_file_count_as_given(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("prefix_reuse: false\nprefix_snapshots: 8\n")
    assert [n.split(":")[0] for n in unused_settings(PredictConfig.from_yaml(path))] == ["prefix_snapshots"]
    assert unused_settings(PredictConfig.from_yaml(path, prefix_reuse=True)) == []
