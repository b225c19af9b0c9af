"""One draft-tree cycle: the drafter's tree (drafter/tree.py) verified in one target pass, walked, and its accepted
path kept through the state transaction.

The walk. At every node the target chooses the token that follows the node's path; from the root, the walk moves to
the child holding the token chosen at the node it stands on, and stops where no child does; the token chosen there
is the bonus.
- Greedy, the target's argmax: the output is plain greedy decoding's, token for token.
- Sampled, a token distributed as the target's filtered distribution p given the path. At a node off the chain, a
  draw from p. At a node of the chain, whose chain child s the selector drew from its q (drafter/selector.py), the
  speculative-sampling rule (engine/sampling.py): s with probability min(1, p(s) / q(s)), else a draw from the
  residual max(p - q, 0), which may still be one of the node's other children. Only one node per depth is ever
  stood on, so each depth's two uniforms are used once: every emitted token is drawn from p given the tokens before
  it, and the output is distributed exactly as plain sampling. The walk leaves a chain node at least as often as a
  chain's verification accepts its proposal, and also when the residual's draw is another child: it accepts at
  least what the chain accepts. At a node off the chain no lossless rule leaves with higher probability than the
  draw from p, which leaves with probability p(children).

The greedy walk runs with the target's pass (engine/target.py: in its CUDA graph); a sampled one after it (with
graphs: in a graph of its own per ranking width, over the pass's outputs). Either ends by staging what the kept
path's commit and the drafter's context read (`stage_path`), so that after the cycle's one read back (the accepted
count, the bonus, the path's tokens) the host only replays the commit.
"""

from __future__ import annotations

import torch

from ..drafter.tree import DraftTree
from ..kernels.tree_paths import descend, stage
from ..models.qwen3_5 import TargetOutput
from .sampling import Sampler, draw, proposal_tests, ranked_probs


def walk(logits: torch.Tensor, tree: DraftTree, max_depth: int, uniforms: torch.Tensor | None = None, draft=None,
         filters=None, width: int | None = None) -> torch.Tensor:
    """The walk (module docstring) on the device: logits [T, V] of the tree pass. Sampled: uniforms [2 (max_depth
    + 1)] float64 (each depth's test, then each depth's draw), draft, (candidate ids, q) [max_depth, K] of the
    chain held in nodes 1, 2, ... (drafter/tree.py), and the request's filters and ranking width (Sampler).
    Returns int64 [2 + 2 (max_depth + 1)]: accepted nodes n, the
    bonus token, the path's node indices (root first; entries past n + 1 are 0), the path's tokens."""
    if uniforms is None:
        chosen = logits.argmax(-1)
    else:
        ids, probs = ranked_probs(logits, *filters, width=width)
        tests, draws = uniforms[:max_depth + 1], uniforms[max_depth + 1:]
        chosen = ids.gather(1, draw(probs, draws[tree.depth]).reshape(-1, 1))[:, 0]
        chain = min(tree.size - 1, max_depth)  # nodes 0 .. chain - 1 hold the chain's nodes 1 .. chain as children
        proposals = tree.tokens[1:chain + 1]
        passed, residual = proposal_tests(ids[:chain], probs[:chain], logits.shape[1], proposals,
                                          draft[0][:chain], draft[1][:chain], tests[:chain])
        redrawn = ids[:chain].gather(1, draw(residual, draws[:chain]).reshape(-1, 1))[:, 0]
        chosen = torch.cat([torch.where(passed, proposals, redrawn), chosen[chain:]])
    return descend(chosen, tree.tokens, tree.parents, tree.depth, tree.valid, max_depth)


def stage_path(state, start, layout, features: torch.Tensor, result: torch.Tensor, max_depth: int) -> torch.Tensor:
    """On the device, from the walk's `result`: the kept path's commit inputs into the state's (DecodeState.path_inputs:
    the pass's `start`, the path, the conv window rows after its last kept node) and, returned, the pass's feature rows
    of the path's nodes in path order [max_depth + 1, F] (rows past the kept ones: the root's)."""
    start_in, path_in, history_rows_in = state.path_inputs(max_depth + 1, result.device)
    if not isinstance(start, torch.Tensor):
        start = torch.full((), start, dtype=torch.long, device=result.device)
    return stage(result, layout.window_rows, features, start, path_in, history_rows_in, start_in)


def tree_cycle(target, proposer, anchor: int, position: int, sampler: Sampler | None):
    """Propose, verify, walk and keep one tree. Returns (the pass's output at the kept rows, the accepted tokens,
    the emitted tokens: the accepted ones and the bonus)."""
    tree = proposer.propose_tree(anchor, position)
    depth = proposer.max_proposals
    sampled = sampler is not None and not sampler.greedy
    features, result = target.run_tree(tree, depth, *((sampler, proposer.tree_draft()) if sampled else ()))
    values = result.tolist()  # the cycle's one read back
    accepted, bonus = values[:2]
    tokens = values[3 + depth:4 + depth + accepted]
    target.state.commit_path(accepted + 1)
    # the drafter's context reads the kept rows' features alone (trees are DFlash2's): no rows of logits or hidden
    return TargetOutput(None, None, features), tokens[1:], tokens[1:] + [bonus]
