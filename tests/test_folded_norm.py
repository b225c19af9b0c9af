"""Norms folded into the W4A16 projections around them (blockspec/layers/folded_norm.py): the two kernel epilogues
against a plain PyTorch computation, and a quantized tiny model with and without folding, through the Triton
interpreter (in a subprocess)."""

import sys

import pytest
import torch
from helpers import (interpreter_part, patch_triton_interpreter, report_parts, run_in_triton_interpreter, run_pass,
                     selected_parts)

from blockspec import kernels
from blockspec.kernels import quant_matmul_triton as wq
from blockspec.quant.int4 import Int4Linear

K = wq.KernelConfig


def _kernel_cases():
    # name, rows, hidden (the producer's N and the consumer's K), consumer N, producer K, producer config
    return [
        ("one row, split-K producer", 1, 640, 96, 1100, K(64, 8, 4, 2, 64)),
        ("8 rows, odd hidden", 8, 650, 70, 512, K(64, 8, 4, 2, 1)),
        ("16 rows, default configs", 16, 576, 130, 600, None),
        ("13 rows, two 8-row dots, split-K producer", 13, 640, 96, 1100, K(64, 16, 4, 2, 64, dot_rows=8)),
        ("33 rows, split-K producer", 33, 320, 40, 600, K(64, 64, 4, 2, 8)),  # a draft tree's pass
        ("64 rows, default configs", 64, 192, 34, 300, None),
    ]


def _plain_reference(x, residual, w_a, norm_weight, w_b, eps):
    """residual + x @ A^T, then the zero-centred RMSNorm, then @ B^T, in fp64 (the folded path's exact value)."""
    summed = residual.double() + x.double() @ w_a.double().t()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * (1 + norm_weight.double())
    return summed, normed @ w_b.double().t()


def _run_kernel_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    results = []
    for name, m, hidden, n_out, k_in, cfg in _kernel_cases():
        g = torch.Generator().manual_seed(m * 31 + hidden)
        a = Int4Linear.from_float(torch.randn(hidden, k_in, generator=g) * 0.05)
        b = Int4Linear.from_float(torch.randn(n_out, hidden, generator=g) * 0.05)
        x, residual = torch.randn(m, k_in, generator=g), torch.randn(m, hidden, generator=g)
        norm_weight, eps = 0.3 * torch.randn(hidden, generator=g), 1e-6
        summed, rows, partials = wq.wq_matmul_add_norm(x, a.packed(), residual, norm_weight, cfg)
        y = wq.wq_matmul(rows, b.packed(), rms=(partials, eps))
        want_summed, want_y = _plain_reference(x, residual, a.dequantize(), norm_weight, b.dequantize(), eps)
        one = wq.wq_matmul_add_norm(x[:1], a.packed(), residual[:1], norm_weight, cfg)
        y_one = wq.wq_matmul(one[1], b.packed(), rms=(one[2], eps))
        # the packed [gate; up] consumer: silu(gate) * up in its launch == the projection, then the activation
        gu = Int4Linear.from_float(torch.randn(2 * n_out, hidden, generator=g) * 0.05)
        act = wq.wq_matmul_swiglu(rows, gu.packed(), rms=(partials, eps))
        gate, up = wq.wq_matmul(rows, gu.packed(), rms=(partials, eps)).split(n_out, dim=-1)
        want_act = torch.nn.functional.silu(gate) * up
        act_one = wq.wq_matmul_swiglu(one[1], gu.packed(), rms=(one[2], eps))
        plain_act = wq.wq_matmul_swiglu(x, Int4Linear.from_float(torch.randn(2 * n_out, k_in, generator=g)).packed())
        # the whole MLP with the next norm begun (one launch where the warp-specialized kernel serves it; here the
        # same two launches): as gate_up's SwiGLU, then down's add_norm
        down = Int4Linear.from_float(torch.randn(hidden, n_out, generator=g) * 0.05)
        mlp = wq.wq_mlp_add_norm(rows, gu.packed(), down.packed(), summed, norm_weight, (partials, eps))
        want_mlp = wq.wq_matmul_add_norm(act, down.packed(), summed, norm_weight)
        counters = kernels._COUNTERS.get(("cpu", None))
        results.append({
            "name": name, "rows": m,
            "act_err": float((act - want_act).abs().max() / want_act.abs().max()),
            "act_shape": list(act.shape) + list(plain_act.shape),
            "act_row0": bool(torch.equal(act_one, act[:1])),
            "summed_err": float((summed.double() - want_summed).abs().max() / want_summed.abs().max()),
            "rows_exact": bool(torch.equal(rows, summed * (1 + norm_weight))),
            "partials_err": float((partials.double().sum(0) - want_summed.pow(2).sum(-1)).abs().max()
                                  / want_summed.pow(2).sum(-1).max()),
            "y_err": float((y.double() - want_y).abs().max() / want_y.abs().max()),
            "row0": bool(torch.equal(one[0], summed[:1]) and torch.equal(y_one, y[:1])),
            "partials_shape": list(partials.shape),
            "mlp_exact": all(bool(torch.equal(a, b)) for a, b in zip(mlp, want_mlp)) and len(mlp) == 3,
            "counters_clean": counters is None or int(counters.abs().sum()) == 0})
    return results


PARTS = {"test_fold_epilogues_match_plain_math_in_interpreter": "kernels",
         "test_folded_int4_model_in_interpreter": "model"}


@pytest.fixture(scope="module")
def interpreted(request, tiny_checkpoint):
    """The kernel cases and the model case (those of the tests selected), run in one interpreter subprocess: one
    start of Python, torch and Triton for both tests, each failing alone on its own part."""
    return run_in_triton_interpreter(__file__, tiny_checkpoint(seed=0, planted=True), *selected_parts(request, PARTS))


def test_fold_epilogues_match_plain_math_in_interpreter(interpreted):
    results = interpreter_part(interpreted, "kernels")
    assert [r["name"] for r in results] == [c[0] for c in _kernel_cases()]
    for r in results:
        assert r["summed_err"] < 1e-5 and r["partials_err"] < 1e-5 and r["y_err"] < 1e-5, r
        assert r["act_err"] < 1e-6 and r["act_shape"][1] == r["act_shape"][3], r
        assert r["rows_exact"], r     # rows = summed * (1 + w), rounded once
        # a row does not depend on the others (plain decoding == verification rows) within one config: <= 8 rows
        assert (r["row0"] and r["act_row0"]) or r["rows"] > 8, r
        assert r["counters_clean"] and r["mlp_exact"], r
    assert results[1]["partials_shape"] == [11, 8]  # one sum per 64-column tile of the 650-wide output, per row


def test_shape_errors_are_named():
    a = Int4Linear.from_float(torch.randn(64, 128))
    for bad in (torch.randn(2, 63), torch.randn(3, 64)):
        try:
            wq.wq_matmul_add_norm(torch.randn(2, 128), a.packed(), bad, torch.zeros(64))
        except ValueError as exc:
            assert "residual" in str(exc)
        else:
            raise AssertionError("a mismatched residual was accepted")
    try:
        wq.wq_matmul(torch.randn(65, 128), a.packed(), rms=(torch.zeros(2, 65), 1e-6))
    except ValueError as exc:
        assert "64 rows" in str(exc)
    else:
        raise AssertionError("65 rows were accepted in one launch")


def test_fold_setting_is_a_config_key():
    from blockspec.config import PredictConfig
    from blockspec.errors import BlockspecError

    assert PredictConfig().fold_norms is True and PredictConfig(fold_norms=False).fold_norms is False
    try:
        PredictConfig.build({"fold_norms": "sometimes"})
    except BlockspecError as exc:
        assert "'fold_norms'" in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError("an invalid fold_norms was accepted")


def _run_model_case(directory):  # executed in a subprocess with TRITON_INTERPRET=1
    from blockspec.engine.engine import Engine
    from blockspec.layers import folded_norm

    kw = dict(device="cpu", compute_dtype="float32", context_length=256, target_quantization="int4")
    # MTP's engine with the MLP's one-launch setting: its folded MLPs go through SwiGLU.add_norm's launch (the
    # two launches on the CPU, as without it)
    plain, mtp = Engine.load(directory, **kw), Engine.load(directory, mode="mtp", persistent_mlp=True, **kw)
    ids = plain.tokenizer.encode("hello world")
    # 8 tokens in two MTP cycles (accepting 2 of 3, then 3 of 3: a partial commit and a whole block), checked as
    # greedy by one pass of the plain engine's model over the prompt and them (plain decoding's one-token steps
    # cost ~2.5 s each in the interpreter)
    b = mtp.generate(ids, 8, stop_at_eos=False)

    def logits(tokens):
        plain.state.reset()
        out = run_pass(plain.model, plain.state, torch.tensor(tokens))
        plain.state.discard()
        return out.logits.double()
    greedy = logits(ids + b.tokens[:-1]).argmax(-1)[len(ids) - 1:].tolist()
    folded = logits(ids[:5])
    folded_norm.enable(plain.model, False)
    unfolded = logits(ids[:5])
    return {
        "folded_norms": [plain.folded_norms, mtp.folded_norms], "layers": len(plain.model.layers),
        "folded_activations": sum(layer.mlp.fold_activation for layer in mtp.model.layers),
        "same_tokens": greedy == b.tokens and len(b.tokens) == 8, "acceptance": b.stats["acceptance_rate"],
        "persistent_mlp": [plain.kernels.persistent_mlp, mtp.kernels.persistent_mlp],
        "logits_err": float((folded - unfolded).abs().max() / unfolded.abs().max())}


@pytest.mark.slow
def test_folded_int4_model_in_interpreter(interpreted):
    """An INT4 tiny model (packed) on the CPU under the interpreter folds every norm but the first and the last, and
    every MLP activation; MTP decoding with folded norms is still greedy decoding with them (each token the argmax
    of the folded model's logits after the ones before); folding moves logits by rounding only."""
    r = interpreter_part(interpreted, "model")
    assert r["folded_norms"] == [2 * r["layers"] - 1] * 2 and r["folded_activations"] == r["layers"], r
    assert r["same_tokens"] and r["acceptance"] > 0.05 and r["persistent_mlp"] == [False, True], r
    assert r["logits_err"] < 1e-4, r


if __name__ == "__main__":  # python test_folded_norm.py CHECKPOINT PART..., with TRITON_INTERPRET=1
    patch_triton_interpreter()
    report_parts({"kernels": _run_kernel_cases, "model": lambda: _run_model_case(sys.argv[1])}, sys.argv[2:])
