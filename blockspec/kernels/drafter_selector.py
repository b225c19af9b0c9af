"""The DFlash2 candidate selector's walk over its rows' candidates, greedy or sampling: the ops, their PyTorch
references and the dispatch to the Triton program (drafter_selector_triton.py); drafter/model.py's
CandidateSelector scores the candidates and calls them.

score(prev -> cand at row i) = logit_i[cand] + < predecessor[prev] * P h_i , successor[cand] >, from the anchor.
"""

from __future__ import annotations

import torch

from . import drafter_selector_triton


def greedy_walk(unary, candidates, projected, anchor, predecessor, successor):
    """From the anchor, pick in each row the candidate with the best unary + transition score given the pick
    before it (the same arithmetic as CandidateSelector.transition_scores). On CUDA one Triton program
    (kernels/drafter_selector_triton.py) instead of ~6 ops per step; else greedy_walk_reference."""
    if drafter_selector_triton.available(unary):
        return drafter_selector_triton.greedy_walk(unary, candidates, projected, anchor, predecessor, successor)
    return greedy_walk_reference(unary, candidates, projected, anchor, predecessor, successor)


def greedy_walk_reference(unary, candidates, projected, anchor, predecessor, successor):
    previous = anchor
    chosen = []
    for row in range(unary.shape[0]):
        query = predecessor[previous][0] * projected[row]
        scores = unary[row] + successor[candidates[row]] @ query
        previous = candidates[row, torch.argmax(scores).reshape(1)]
        chosen.append(previous)
    return torch.cat(chosen)


def sampled_walk(unary, candidates, projected, anchor, predecessor, successor, temperature, uniforms):
    """The walk drawing each row's pick from q = softmax(scores / temperature) (the pick before it given) by inverse
    CDF with the row's uniform; greedy where temperature is 0. Returns (chosen [n], q [n, K] float32; q is left
    unset when greedy). On CUDA one Triton program (kernels/drafter_selector_triton.py); else sampled_walk_reference."""
    if drafter_selector_triton.available(unary):
        return drafter_selector_triton.sampled_walk(unary, candidates, projected, anchor, predecessor, successor,
                                                    temperature, uniforms)
    return sampled_walk_reference(unary, candidates, projected, anchor, predecessor, successor, temperature,
                                  uniforms)


def sampled_walk_reference(unary, candidates, projected, anchor, predecessor, successor, temperature, uniforms):
    hot = temperature > 0
    scale = torch.where(hot, temperature, 1.0)  # greedy rows ignore q: keep it finite
    previous = anchor
    chosen, probs = [], []
    for row in range(unary.shape[0]):
        query = predecessor[previous][0] * projected[row]
        scores = unary[row] + successor[candidates[row]] @ query
        weights = torch.exp((scores.float() - scores.float().max()) / scale)
        cdf = weights.cumsum(0)
        drawn = (cdf < uniforms[row].float() * cdf[-1]).sum()
        index = torch.where(hot, drawn, torch.argmax(scores))
        previous = candidates[row, index.reshape(1)]
        chosen.append(previous)
        probs.append(weights / cdf[-1])
    return torch.cat(chosen), torch.stack(probs)
