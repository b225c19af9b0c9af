"""The DFlash2 drafter's candidate selector walk in one Triton program, greedy or sampling, the fast path of
`greedy_walk` and `sampled_walk` (drafter_selector.py), whose references are `greedy_walk_reference` and
`sampled_walk_reference` there.

Why: the walk is n dependent steps of a few tiny ops each; torch.compile makes it a few kernels but traces it
again at every start (time the drafter's graph preparation would pay), while a Triton kernel loads from Triton's
disk cache. One program walks all rows: each step gathers the previous pick's predecessor code and the K
candidates' successor codes (K x rank values, L2-resident after the first proposal).
Rounding as the reference: the query and the dot products are rounded to the codebooks' dtype (a matmul's output),
and their sum with the unary logits to the logits' dtype (float32 from the engine's head: not rounded); exact ties go
to the first candidate, as argmax does. Sampling reads the temperature from the device: at 0 the program takes
the greedy branch (the same arithmetic as the greedy walk), so one CUDA graph serves greedy and sampled requests.
"""

from __future__ import annotations

import torch

from . import pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the reference
    triton = None

MAX_ROWS = 16


def available(unary: torch.Tensor) -> bool:
    return triton_runs_on(unary) and unary.shape[0] <= MAX_ROWS


def greedy_walk(unary, candidates, projected, anchor, predecessor, successor) -> torch.Tensor:
    """Same contract as the reference: unary / candidates [n, K], projected [n, rank], anchor [1], codebooks
    [vocab, rank] -> chosen token ids [n] (int64)."""
    return _walk(unary, candidates, projected, anchor, predecessor, successor)[0]


def sampled_walk(unary, candidates, projected, anchor, predecessor, successor, temperature, uniforms):
    """Same contract as sampled_walk_reference: also temperature (0-dim) and uniforms [n] (float64, in (0, 1])
    -> (chosen token ids [n], q [n, K] float32, left unset when greedy)."""
    return _walk(unary, candidates, projected, anchor, predecessor, successor, temperature, uniforms)


def _walk(unary, candidates, projected, anchor, predecessor, successor, temperature=None, uniforms=None):
    rows, top_k = unary.shape
    rank = projected.shape[1]
    unary, candidates, projected = unary.contiguous(), candidates.contiguous(), projected.contiguous()
    chosen = torch.empty(rows, device=unary.device, dtype=torch.long)
    sample = temperature is not None
    probs = torch.empty(rows, top_k, device=unary.device, dtype=torch.float32) if sample else None
    _walk_kernel[(1,)](unary, candidates, projected, anchor, predecessor, predecessor.stride(0), successor,
                       successor.stride(0), chosen, temperature if sample else unary, uniforms if sample else unary,
                       probs if sample else unary, ROWS=rows, TOP_K=top_k, RANK=rank,
                       BLOCK_K=triton.next_power_of_2(top_k), BLOCK_R=triton.next_power_of_2(rank), SAMPLE=sample,
                       num_warps=4, **pdl.options(unary))
    return chosen, probs


if triton is not None:
    @triton.jit
    def _walk_kernel(unary, candidates, projected, anchor, predecessor, s_pred, successor, s_succ, chosen,
                     temperature, uniforms, probs, ROWS: tl.constexpr, TOP_K: tl.constexpr, RANK: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SAMPLE: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        ks = tl.arange(0, BLOCK_K)
        rs = tl.arange(0, BLOCK_R)
        k_ok = ks < TOP_K
        r_ok = rs < RANK
        dtype = successor.dtype.element_ty
        previous = tl.load(anchor).to(tl.int64)
        hot = False
        if SAMPLE:
            t = tl.load(temperature).to(tl.float32)
            hot = t > 0
        for row in tl.static_range(ROWS):
            code = tl.load(predecessor + previous * s_pred + rs, mask=r_ok, other=0.0).to(tl.float32)
            query = (code * tl.load(projected + row * RANK + rs, mask=r_ok, other=0.0).to(tl.float32)).to(dtype)
            cand = tl.load(candidates + row * TOP_K + ks, mask=k_ok, other=0).to(tl.int64)
            codes = tl.load(successor + cand[:, None] * s_succ + rs[None, :], mask=k_ok[:, None] & r_ok[None, :],
                            other=0.0)
            dots = tl.sum(codes.to(tl.float32) * query.to(tl.float32)[None, :], 1).to(dtype)
            scores = (tl.load(unary + row * TOP_K + ks, mask=k_ok, other=0.0).to(tl.float32)
                      + dots.to(tl.float32)).to(unary.dtype.element_ty).to(tl.float32)
            scores = tl.where(k_ok, scores, float("-inf"))
            best = tl.argmax(scores, 0, tie_break_left=True)
            if SAMPLE:
                if hot:  # inverse CDF over q = softmax(scores / t), rounded as the reference
                    weights = tl.exp((scores - tl.max(scores, 0)) / t)
                    cdf = tl.cumsum(weights, 0)
                    total = tl.max(cdf, 0)
                    u = tl.load(uniforms + row).to(tl.float32)
                    best = tl.sum((cdf < u * total).to(tl.int32), 0)
                    tl.store(probs + row * TOP_K + ks, weights / total, mask=k_ok)
            previous = tl.sum(tl.where(ks == best, cand, 0), 0)
            tl.store(chosen + row, previous)
