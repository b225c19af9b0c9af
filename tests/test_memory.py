"""GPU memory: the estimate made from shapes before loading against the bytes a loaded engine holds, the one-line
refusal when the free memory cannot hold it (before any tensor is read), and the report's fields on the CPU."""

import json
import re

import pytest
import torch

import blockspec.models.checkpoint
from blockspec.cli import main
from blockspec.config import PredictConfig, TargetConfig
from blockspec.engine import memory
from blockspec.engine.engine import Engine
from blockspec.engine.load import pass_rows
from blockspec.errors import BlockspecError

TOLERANCE = 0.01  # the layouts are sized exactly; FP8 block rows differ slightly between packed and unpacked


@pytest.mark.parametrize("mode,settings", [
    ("none", {"target_quantization": "fp8"}),
    ("mtp", {"target_quantization": "int4", "vocabulary_quantization": "int8"}),
    ("dflash2", {"target_quantization": "int4", "vocabulary_quantization": "int8", "dflash2_quantization": "int8",
                 "draft_vocabulary": 64}),
])
def test_estimate_matches_the_loaded_engine(tiny_checkpoint, tiny_drafter, mode, settings):
    target = tiny_checkpoint(seed=0, planted=True)
    drafter = {"dflash2_model": str(tiny_drafter(target))} if mode == "dflash2" else {}
    config = PredictConfig.build({"model": str(target), "mode": mode, "device": "cpu", "compute_dtype": "float32",
                                  "context_length": 512, **settings, **drafter})
    rows = pass_rows(config.tree_budget)  # a DFlash2 engine's: a tree's by default
    r = memory.checkpoint_estimate(config, execution="eager", max_partial=rows).resident
    engine = Engine(config)
    measured = {"target": engine.memory.target["final_bytes"], **engine.memory.caches}
    estimated = {"target": r["target_layers"] + r["embedding"] + r.get("head", 0),
                 "decode_state": r["kv_cache"] + r["deltanet_state"], "prefix_snapshots": r["prefix_snapshots"]}
    if mode == "mtp":
        measured["mtp"], estimated["mtp"] = engine.memory.mtp["final_bytes"], r["mtp_head"]
        estimated["mtp_cache"] = r["mtp_cache"]
    if mode == "dflash2":
        measured["drafter"], estimated["drafter"] = engine.memory.drafter["final_bytes"], r["drafter"]
        measured["draft_head"], estimated["draft_head"] = engine.memory.draft_head_bytes, r["draft_head"]
        estimated["drafter_context"] = r["drafter_context"]
    assert set(estimated) == set(measured)
    for part, real in measured.items():
        assert estimated[part] == pytest.approx(real, rel=TOLERANCE), part


def test_a_gpu_too_small_is_refused_in_one_line_before_loading(tiny_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "free_and_total", lambda device: (100_000, 8_000_000_000))

    def no_reading(*args, **kwargs):
        raise AssertionError("tensors were read before the memory check")
    monkeypatch.setattr(blockspec.models.checkpoint, "read_tensors", no_reading)
    code = main(["generate", "--model", str(tiny_checkpoint(seed=0, max_position_embeddings=262144)), "--prompt",
                 "hi", "--device", "cuda", "--dtype", "float32", "--context-length", "262144"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "estimated GPU memory needed" in err and "0.0 GB of cuda:0 is free" in err
    assert "kv cache" in err and "lower context_length (262144)" in err and "int8" in err


def test_the_check_passes_what_fits_and_counts_the_loading_peak(monkeypatch):
    needed = memory.MemoryEstimate({"weights": 10}, {"target_read": 20})
    monkeypatch.setattr(memory, "free_and_total", lambda device: (20, 40))
    memory.check_fits(needed, PredictConfig(), torch.device("cuda", 0))
    monkeypatch.setattr(memory, "free_and_total", lambda device: (19, 40))
    with pytest.raises(BlockspecError, match="target read at load"):
        memory.check_fits(needed, PredictConfig(), torch.device("cuda", 0))


def test_generate_json_reports_memory_with_null_gpu_peaks_on_the_cpu(tiny_checkpoint, capsys):
    code = main(["generate", "--model", str(tiny_checkpoint(seed=0)), "--prompt-ids", "5,6,7", "--max-tokens", "4",
                 "--json", "--device", "cpu", "--dtype", "float32"])
    report = json.loads(capsys.readouterr().out)["stats"]["memory"]
    assert code == 0
    assert report["peak_allocated_bytes"] is None and report["gpu_held_bytes"] is None
    assert report["target"]["final_bytes"] > 0 and report["caches"]["decode_state"] > 0
    assert "estimate" not in report and "workspace_peak_bytes" not in report  # estimated and measured on CUDA only


QUANTIZED_27B = {"mode": "dflash2", "target_quantization": "int4", "vocabulary_quantization": "int8",
                 "dflash2_quantization": "int8", "context_length": 32768}


def estimates_27b(max_partial=16, **settings):
    """The 27B's estimate (synthetic preset, published drafter's shapes) with QUANTIZED_27B and passes of up to
    max_partial rows, and the bytes of its decoder layers dense."""
    from blockspec.drafter.config import DrafterConfig
    from blockspec.models.qwen3_5 import TargetModel
    from blockspec.fixtures.synthetic import preset, synthetic_drafter_config

    target = TargetConfig.from_dict(preset("qwen3.5-27b"), source="synthetic preset qwen3.5-27b")
    drafter = DrafterConfig.from_dict(synthetic_drafter_config(target))
    with torch.device("meta"):
        layers = sum(p.numel() for p in TargetModel(target).layers.parameters()) * 2  # bf16
    return memory.estimate(target, PredictConfig.build(QUANTIZED_27B), execution="cuda-graphs",
                           max_partial=max_partial, drafter=drafter, **settings), layers


def test_the_synthetic_27b_quantized_at_load_fits_a_32gb_card(monkeypatch):
    """Each projection is quantized as it is read (as each synthetic layer is built): loading holds the quantized
    layers, one dense projection and the dense head, far below the 48.7 GB of dense layers, and below what decoding
    holds."""
    from blockspec.bench import check_synthetic_fits

    at_load, dense_layers = estimates_27b()
    assert dense_layers > 48e9
    assert max(at_load.loading.values()) < sum(at_load.resident.values()) == at_load.needed < 24e9
    assert at_load.loading["target_read"] < 0.4 * dense_layers
    assert set(at_load.loading) == {"target_read", "head_quantization", "drafter_read"}
    monkeypatch.setattr(memory, "free_and_total", lambda device: (31 * 10 ** 9, 32 * 10 ** 9))
    config = PredictConfig.build(QUANTIZED_27B)
    assert check_synthetic_fits("qwen3.5-27b", config, torch.device("cuda", 0)).needed == at_load.needed
    monkeypatch.setattr(memory, "free_and_total", lambda device: (20 * 10 ** 9, 32 * 10 ** 9))
    needed = re.escape(f"needed {at_load.needed / 1e9:.1f} GB (target layers 12.6 GB, ")
    with pytest.raises(BlockspecError, match=needed):
        check_synthetic_fits("qwen3.5-27b", config, torch.device("cuda", 0))


def test_a_stored_int4_27b_loads_within_its_resident_bytes():
    """A GPTQ / AWQ checkpoint's stored parts come to the GPU one projection at a time (models/checkpoint.py): its loading
    moments stay below what decoding holds, as quantizing a dense checkpoint at load does."""
    stored, _ = estimates_27b(stored=memory.Layout("int4", 128, symmetric=False))
    at_load, _ = estimates_27b()
    assert stored.needed == sum(stored.resident.values()) < 24e9
    assert max(stored.loading.values()) < 0.95 * sum(stored.resident.values())
    assert at_load.needed < stored.needed  # no zero points


def test_graph_pools_grow_with_the_longest_pass():
    """A draft tree's 64-row pass: its activations and logits (and the sampler's) take 4x a 16-row chain's."""
    chain, _ = estimates_27b()
    tree, _ = estimates_27b(max_partial=64)
    assert tree.resident["graph_pools"] == 4 * chain.resident["graph_pools"] == 2 ** 30
    assert tree.resident["deltanet_state"] > chain.resident["deltanet_state"]  # the pending rows of a path commit


def test_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    memory.use_expandable_segments(torch.device("cpu"))
    assert calls == []
    memory.use_expandable_segments(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # the user's choice stands
    memory.use_expandable_segments(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]
