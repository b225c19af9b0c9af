"""Synthetic weights (blockspec/fixtures/synthetic.py): deterministic given the seed, planted, and quantized as each layer is
built to exactly what quantizing the dense model after building gives."""

import math

import pytest
import torch
from torch import nn

from blockspec.engine.weights import prepare, rtn
from blockspec.fixtures import synthetic
from blockspec.fixtures.synthetic import synthetic_target
from blockspec.models.qwen3_5 import DecoderLayer


def assert_same(a, b):
    assert [type(m) for m in a.modules()] == [type(m) for m in b.modules()]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_quantized_as_built_equals_quantized_after_building(monkeypatch):
    quantize = rtn("int4", 128, torch.float32)
    dense, dense_head = synthetic_target("tiny", "cpu", torch.float32, seed=3)
    prepare(dense, quantize, lambda name: name.startswith("layers."))

    materialized, real = [], synthetic.materialize_

    def materialize_(module, device, dtype):
        materialized.append(module)
        real(module, device, dtype)

    def counting_quantize(linear):  # the decoder layers on the device with a dense projection: the current one
        assert sum(isinstance(m, DecoderLayer) and any(type(s) is nn.Linear for s in m.modules())
                   for m in materialized) == 1
        return quantize(linear)

    monkeypatch.setattr(synthetic, "materialize_", materialize_)
    built, built_head = synthetic_target("tiny", "cpu", torch.float32, seed=3, quantize=counting_quantize)
    assert_same(built, dense)
    assert_same(built_head, dense_head)  # the MTP head is returned dense, for the engine to quantize


def test_weights_are_seeded_and_planted():
    model, head = synthetic_target("tiny", "cpu", torch.float32, seed=3)
    again, again_head = synthetic_target("tiny", "cpu", torch.float32, seed=3)
    other, _ = synthetic_target("tiny", "cpu", torch.float32, seed=4)
    assert_same(model, again)
    assert_same(head, again_head)
    alone, no_head = synthetic_target("tiny", "cpu", torch.float32, seed=3, mtp_head=False)
    assert no_head is None
    assert_same(model, alone)  # the head has its own generator: without it the model is the same
    for a, b in zip(model.parameters(), other.parameters()):
        assert a.dim() == 1 or not torch.equal(a, b)  # norms and decays are constant; every matrix differs
    # each layer its own weights, its outputs scaled down below the embedding (plant_permutation_)
    first, second = (layer.mlp.gate_up_proj.parts[0].weight for layer in model.layers[:2])
    assert not torch.equal(first, second)
    for layer in model.layers:
        out = layer.self_attn.o_proj if layer.is_attention else layer.linear_attn.out_proj
        for projection, std in ((out, 0.05), (layer.mlp.down_proj, 0.05), (layer.mlp.gate_up_proj.parts[0], 1.0)):
            assert float(projection.weight.std()) * math.sqrt(projection.in_features) == pytest.approx(std, rel=0.2)
    # the head row of perm(t) is the embedding of t
    perm = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(3 + 1))
    assert torch.equal(model.lm_head.weight[perm], model.embed_tokens.weight)
