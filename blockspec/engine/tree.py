"""One draft-tree cycle: the drafter's tree (drafter/tree.py) verified in one target pass, walked, and its accepted
path kept through the state transaction.

The walk. At every node the target chooses the token that follows the node's path: its argmax (greedy), or a draw
from its filtered distribution p with the uniform of the node's depth (sampled). From the root, the walk moves to
the child holding the token chosen at the node it stands on, and stops where no child does; the token chosen there
is the bonus. Greedy, the output is plain greedy decoding's, token for token. Sampled, every emitted token is drawn
from p given the tokens before it (only one node per depth is ever stood on, so the draws along the path use
independent uniforms): the output is distributed exactly as plain sampling. For a tree fixed before the target's
pass, no lossless rule leaves a node with higher probability than this one: the token emitted at a node must be
distributed as p, so it lies among the node's children with probability p(children) at most, which this rule
reaches. (Multi-candidate rejection sampling gains only where the candidates were drawn at random.)

The greedy walk runs with the target's pass (engine/target.py: in its CUDA graph); a sampled one after it.
The host reads back once per cycle: the accepted count, the bonus, the path's nodes and tokens.
"""

from __future__ import annotations

import torch

from ..drafter.tree import DraftTree
from ..models.qwen3_5 import TargetOutput
from .sampling import Sampler, draw, ranked_probs


def walk(logits: torch.Tensor, tree: DraftTree, max_depth: int, sampler: Sampler | None = None,
         uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """The walk (module docstring) on the device: logits [T, V] of the tree pass; uniforms [max_depth + 1] float64
    when sampled. Returns int64 [2 + 2 (max_depth + 1)]: accepted nodes n, the bonus token, the path's node indices
    (root first; entries past n + 1 are 0), the path's tokens."""
    if uniforms is None:
        chosen = logits.argmax(-1)
    else:
        ids, probs = ranked_probs(logits, *sampler.filters(), width=sampler.width())
        chosen = ids.gather(1, draw(probs, uniforms[tree.depth]).reshape(-1, 1))[:, 0]
    on_path = tree.depth == 0
    follows = tree.valid & (tree.tokens == chosen[tree.parents])
    for level in range(1, max_depth + 1):
        steps = (tree.depth == level) & follows & on_path[tree.parents]
        on_path = on_path | (steps & (steps.cumsum(0) == 1))  # siblings are distinct tokens; a forced tree's may not be
    levels = torch.arange(max_depth + 1, device=logits.device)
    path = (on_path[None, :] & (tree.depth[None, :] == levels[:, None])).to(torch.uint8).argmax(-1)
    accepted = on_path.sum(0, keepdim=True) - 1
    bonus = chosen.index_select(0, path.index_select(0, accepted))
    return torch.cat([accepted, bonus, path, tree.tokens[path]])


def tree_cycle(target, proposer, anchor: int, position: int, sampler: Sampler | None):
    """Propose, verify, walk and keep one tree. Returns (the pass's output at the kept rows, the accepted tokens,
    the emitted tokens: the accepted ones and the bonus)."""
    tree = proposer.propose_tree(anchor, position)
    depth = proposer.max_proposals
    out, layout, result = target.run_tree(tree, depth)  # the greedy walk, in the pass's graph
    if sampler is not None and not sampler.greedy:
        result = walk(out.logits, tree, depth, sampler, sampler.uniforms(depth + 1).to(out.logits.device))
    values = result.tolist()  # the cycle's one read back
    accepted, bonus = values[:2]
    path = result[2:3 + accepted]
    tokens = values[3 + depth:4 + depth + accepted]
    target.state.commit_path(path, layout.window_rows[values[2 + accepted], 1:])
    kept = TargetOutput(out.logits.index_select(0, path), out.hidden.index_select(0, path),
                        None if out.features is None else out.features.index_select(0, path))
    return kept, tokens[1:], tokens[1:] + [bonus]
