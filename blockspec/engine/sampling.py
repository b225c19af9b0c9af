"""Sampling: how each token is chosen from the target's float32 logits, in every mode.

Greedy (temperature 0) takes the argmax, and a speculative cycle keeps the longest prefix of proposals equal to the
target's argmax plus the target's next argmax (`leading_matches`).

Sampled requests (SamplingSettings, config.py):
  `ranked_probs`     the target's distribution p after the filters, in the order vLLM and transformers apply them:
                     temperature, top-k (ties with the k-th token kept), top-p (the most likely tokens whose mass
                     before them is below top_p), min-p (tokens at least min_p times as likely as the most likely
                     one), renormalised. The filter values are tensors, so one CUDA graph serves every setting. A top-k
                     request with k <= 64 ranks only each row's 128 highest scores (a top-k selection instead of a
                     sort of the vocabulary, which would cost a sampled 8-row verification ~1 ms on the 27B).
  `draw`             one token per row by inverse CDF, one uniform in (0, 1] per row; a token of probability 0 is
                     never drawn.
  `speculative_accept` the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): proposal x_i, drawn
                     from the proposer's distribution q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i));
                     the first rejected position is drawn from the normalised residual max(p_i - q_i, 0), and after
                     k acceptances the bonus token from p_k. Each emitted token is then distributed exactly as plain
                     sampling from the target, whatever the proposer proposes, provided q is the distribution the
                     proposal was really drawn from (the MTP head's processed distribution; the DFlash2 selector's
                     softmax over its candidates, given the pick before).
  `walk`             a draft tree's acceptance. At every node the target chooses the token that follows the node's
                     path; from the root, the walk moves to the child holding the token chosen at the node it stands
                     on, and stops where no child does; the token chosen there is the bonus. Greedy, the target's
                     argmax: the output is plain greedy decoding's, token for token. Sampled, a token distributed as
                     p given the path: at a node off the chain, a draw from p; at a node of the chain, whose chain
                     child s the selector drew from its q, the speculative-sampling rule: s with probability
                     min(1, p(s) / q(s)), else a draw from the residual max(p - q, 0), which may still be one of the
                     node's other children. Only one node per depth is ever stood on, so each depth's two uniforms
                     are used once: every emitted token is drawn from p given the tokens before it, and the output is
                     distributed exactly as plain sampling. The walk leaves a chain node at least as often as a
                     chain's verification accepts its proposal, and also when the residual's draw is another child:
                     it accepts at least what the chain accepts. At a node off the chain no lossless rule leaves with
                     higher probability than the draw from p, which leaves with probability p(children).

Randomness: every draw and acceptance test consumes uniforms from a CPU torch.Generator seeded per request (its
seed, or a fresh one), copied to the device beside the ids and positions each pass already receives. No random
number is generated on the device, so the CUDA graphs need no generator state registered with them and replay
validly as they are; eager and graphed runs draw the same numbers; the same seed (and request) gives the same tokens
on the same machine and mode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import SamplingSettings
from ..kernels.tree_paths import descend
from ..layers.tree import DraftTree
from . import graphs


TOP_K_CAP = 128  # top-k requests with k <= TOP_K_CAP // 2 rank only the TOP_K_CAP highest scores of each row


def filtered(ordered: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """Float32 probabilities [R, C] of scores sorted in descending order (already divided by the temperature) after
    top-k, top-p and min-p (module docstring), renormalised; the filter values are 0-dim tensors (top_k 0: no
    limit) or numbers."""
    width = ordered.shape[-1]
    limit = torch.where(torch.as_tensor(top_k, device=ordered.device) > 0, top_k, width).clamp(max=width)
    kth = ordered.gather(-1, (limit - 1).reshape(1, 1).expand(ordered.shape[0], 1))
    probs = torch.softmax(ordered.masked_fill(ordered < kth, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
    keep = (before < top_p) | (torch.as_tensor(top_p, device=ordered.device) >= 1)
    keep &= probs >= min_p * probs[:, :1]
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def ranked_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p, width: int | None = None):
    """(token ids, probabilities) [R, C] of float32 logits [R, V] after the filters, the ids in descending order of
    score: over the whole vocabulary (width None: one sort of each row), or over the `width` highest scores (a
    top-k selection, no sort of the vocabulary: for top-k requests with k well below width, whose ties with the
    k-th score are then kept up to width tokens)."""
    scores = logits.float() / temperature
    if width is None or width >= scores.shape[-1]:
        ordered, ids = scores.sort(dim=-1, descending=True)
    else:
        ordered, ids = scores.topk(width, dim=-1)
    return ids, filtered(ordered, top_k, top_p, min_p)


def processed_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """Float32 probabilities [R, V] of float32 logits [R, V] after the filters, in vocabulary order."""
    ids, probs = ranked_probs(logits, temperature, top_k, top_p, min_p)
    return torch.zeros_like(probs).scatter_(-1, ids, probs)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of probs [R, V] (not necessarily normalised): the first whose cumulative mass reaches u x
    total, u in (0, 1] (float64). The cumulative sums run in float64, so that a 248k-token row keeps its tail."""
    cdf = probs.double().cumsum(-1)
    threshold = uniforms.reshape(-1, 1) * cdf[:, -1:]
    return (cdf < threshold).sum(-1)


def leading_matches(proposals: list[int], predicted: list[int]) -> int:
    """The greedy rule: how many proposals equal the target's argmax at their positions, from the first on."""
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == predicted[accepted]:
        accepted += 1
    return accepted


def speculative_accept(logits, tokens, draft_ids, draft_probs, uniforms, filters, width=None) -> torch.Tensor:
    """The speculative-sampling rule on the device (module docstring), no host synchronisation. logits [T, V] of the
    pass over tokens [T] (anchor + T - 1 proposals); draft_ids / draft_probs [T - 1, C]: the proposer's distribution
    of each proposal over C token ids (repeated ids add up); uniforms [T] float64 in (0, 1]; filters: temperature,
    top_k, top_p, min_p; width: ranked_probs'. Returns int64 [2]: (accepted proposals n, the token after them).
    p is kept over its ranked ids: the residual max(p - q, 0) is 0 wherever p is."""
    ids, p = ranked_probs(logits, *filters, width=width)
    k = tokens.shape[0] - 1
    if k == 0:
        return torch.cat([torch.zeros(1, dtype=torch.long, device=p.device), ids[0, draw(p, uniforms[:1])]])
    ok, residual = proposal_tests(ids[:k], p[:k], logits.shape[1], tokens[1:], draft_ids, draft_probs, uniforms[:k])
    accepted = ok.long().cumprod(0).sum()
    final = torch.cat([residual, p[k:]]).index_select(0, accepted.reshape(1))   # row k: the bonus token's p
    row_ids = ids.index_select(0, accepted.reshape(1))
    return torch.cat([accepted.reshape(1), row_ids[0, draw(final, uniforms[k:])]])


def proposal_tests(ids, p, vocab_size: int, proposals, draft_ids, draft_probs, uniforms):
    """The rule's test of each row's proposal: p [k, C] over ranked ids [k, C] (ranked_probs), proposals [k] drawn
    from q over draft_ids / draft_probs [k, C'] (repeated ids add up), uniforms [k] float64. Returns (whether each
    is accepted [k], the residual max(p - q, 0) [k, C] over the same ids: p where q equals p, which never rejects)."""
    q = torch.zeros(ids.shape[0], vocab_size, device=p.device).scatter_add_(1, draft_ids, draft_probs.float())
    proposals = proposals.reshape(-1, 1)
    p_proposed = torch.where(ids == proposals, p, 0.0).sum(-1)
    accepted = uniforms * q.gather(1, proposals)[:, 0] < p_proposed
    residual = (p - q.gather(1, ids)).clamp_min(0)
    return accepted, torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def walk(logits: torch.Tensor, tree: DraftTree, max_depth: int, uniforms: torch.Tensor | None = None, draft=None,
         filters=None, width: int | None = None) -> torch.Tensor:
    """A draft tree's acceptance rule (module docstring), on the device: logits [T, V] of the tree pass. Sampled:
    uniforms [2 (max_depth + 1)] float64 (each depth's test, then each depth's draw), draft, (candidate ids, q)
    [max_depth, K] of the chain held in nodes 1, 2, ... (layers/tree.py), and the request's filters and ranking
    width (Sampler). Returns int64 [2 + 2 (max_depth + 1)]: accepted nodes n, the bonus token, the path's node
    indices (root first; entries past n + 1 are 0), the path's tokens."""
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


def fresh_seed() -> int:
    """A seed within SamplingSettings' range, so that the one a request reports can be sent back."""
    return int.from_bytes(os.urandom(8), "little") >> 1


@dataclass
class _AcceptGraph:
    graph: object
    logits: torch.Tensor
    tokens: torch.Tensor
    draft_ids: torch.Tensor
    draft_probs: torch.Tensor
    uniforms: torch.Tensor
    result: torch.Tensor


class Sampler:
    """One engine's sampling state: the request's settings (`begin`), their values on the device (inputs of every
    graph that samples), the request's random stream, and the acceptance rule, eager or as a CUDA graph per
    verification length (`capture_graphs`)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.settings = SamplingSettings()
        self.greedy = True               # the request's settings are greedy (temperature 0)
        self.seed: int | None = None   # the request's seed (drawn fresh when it gave none); None when greedy
        self.generator = torch.Generator()
        # the filter values of the request; temperature 1 until the engine's first begin(), so that the warm-ups of
        # the graphs that sample stay finite
        self.temperature = torch.ones((), device=self.device)
        self.top_k = torch.zeros((), dtype=torch.long, device=self.device)
        self.top_p = torch.ones((), device=self.device)
        self.min_p = torch.zeros((), device=self.device)
        self.graphs: dict[int, _AcceptGraph] = {}

    def filters(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p

    def begin(self, settings: SamplingSettings):
        """Start a request with these settings (greedy ones set temperature 0: the DFlash2 walk reads it)."""
        self.settings, self.greedy = settings, settings.greedy
        self.seed = None if settings.greedy else settings.seed if settings.seed is not None else fresh_seed()
        if self.seed is not None:
            self.generator.manual_seed(self.seed)
        values = (settings.temperature, settings.top_k, settings.top_p, settings.min_p)
        for tensor, value in zip(self.filters(), values):
            tensor.fill_(value)

    def describe(self) -> dict:
        """The request's settings as its stats report them (the seed actually used, so a run can be repeated)."""
        if self.greedy:
            return {"temperature": 0.0}
        return {**self.settings.model_dump(), "seed": self.seed}

    def uniforms(self, n: int) -> torch.Tensor:
        """The request's next n uniforms in (0, 1] (float64, on the CPU)."""
        return 1.0 - torch.rand(n, generator=self.generator, dtype=torch.float64)

    def width(self) -> int | None:
        """The ranking width of the request's filters (ranked_probs): TOP_K_CAP for top-k requests with k at most
        half of it, else the whole vocabulary."""
        top_k = self.settings.top_k
        return TOP_K_CAP if 0 < top_k <= TOP_K_CAP // 2 else None

    def first_token(self, logits: torch.Tensor) -> int:
        """The token after the prompt, from the last prompt row's logits [1, V]."""
        if self.greedy:
            return int(logits.argmax())
        ids, probs = ranked_probs(logits, *self.filters(), width=self.width())
        return int(ids[0, draw(probs, self.uniforms(1).to(self.device))])

    def accept(self, logits: torch.Tensor, tokens: torch.Tensor, draft) -> torch.Tensor:
        """(accepted proposals, the token after them), int64 [2] on the device, of a pass over tokens (anchor +
        proposals, int64 [t] on the device) whose logits are `logits`; draft: (ids, probs) [t - 1, C] of the
        proposals (None without proposals)."""
        t = tokens.shape[0]
        uniforms = self.uniforms(t)
        captured = self.graphs.get((t, self.width()))
        if captured is None:
            draft_ids, draft_probs = draft if draft is not None else (None, None)
            return speculative_accept(logits, tokens, draft_ids, draft_probs, uniforms.to(self.device),
                                      self.filters(), self.width())
        captured.logits.copy_(logits)
        captured.tokens.copy_(tokens)
        captured.uniforms.copy_(uniforms, non_blocking=True)
        if draft is not None:
            captured.draft_ids.copy_(draft[0])
            captured.draft_probs.copy_(draft[1])
        captured.graph.replay()
        return captured.result

    def capture_graphs(self, lengths, vocab_size: int, draft_width: int, pool=None, warmup: int = 2):
        """With CUDA graphs: the acceptance of each pass length the mode verifies (1: plain decoding; 1 + k) and
        each ranking width, over static inputs; other lengths run eagerly."""
        for t, width in ((t, w) for t in sorted(set(lengths)) for w in (None, TOP_K_CAP)):
            logits = torch.zeros(t, vocab_size, device=self.device)
            tokens = torch.zeros(t, dtype=torch.long, device=self.device)
            draft_ids = torch.zeros(t - 1, max(draft_width, 1), dtype=torch.long, device=self.device)
            draft_probs = torch.zeros(t - 1, max(draft_width, 1), device=self.device)
            uniforms = torch.ones(t, dtype=torch.float64, device=self.device)
            graph, result = graphs.capture(lambda: speculative_accept(logits, tokens, draft_ids, draft_probs,
                                                                      uniforms, self.filters(), width), warmup, pool)
            self.graphs[t, width] = _AcceptGraph(graph, logits, tokens, draft_ids, draft_probs, uniforms, result)
