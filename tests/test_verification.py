"""Verification with forced proposals: all right, all wrong, wrong at each position. After every cycle the
committed target state (and the proposer's own committed cache) must equal a plain run over the same tokens."""

import pytest
import torch
from helpers import LAYER_MIXES, run_pass, save_hf_target

from blockspec.models.checkpoint import load_target
from blockspec.engine.decode import DecodeStats, Proposer, decode
from blockspec.engine.state import DecodeState
from blockspec.engine.target import EagerTarget
from blockspec.layers.attention import KVCache


def committed_state(state):
    parts = []
    for s in state.layers:
        if isinstance(s, KVCache):
            parts += [s.k[:state.length], s.v[:state.length]]
        else:
            parts += [s.history, s.recurrent]
    return parts


def plain_state(model, tokens):
    state = DecodeState(model, 256, 16, "cpu", torch.float32)
    run_pass(model, state, torch.tensor(tokens))
    state.commit(len(tokens))
    return state


class ForcedProposer(Proposer):
    """Proposes the plain-greedy continuation, corrupted from index `wrong_from` on (None: all right)."""

    def __init__(self, model, trajectory, k, wrong_from, inner=None, check=None):
        self.model, self.trajectory, self.max_proposals = model, trajectory, k
        self.wrong_from, self.inner, self.check = wrong_from, inner, check
        self.capture_layers = inner.capture_layers if inner else ()
        self.accepted_log = []

    def reset(self):
        if self.inner:
            self.inner.reset()

    def observe(self, out, first, tokens, next_tokens, drafts=True):
        if self.inner:
            self.inner.observe(out, first, tokens, next_tokens, drafts)
        if self.check:
            self.check(first + len(tokens))

    def propose(self, anchor, position, k):
        if self.inner:
            self.inner.propose(anchor, position, k)  # exercises the proposer's scratch writes
        truth = self.trajectory[position + 1:position + 1 + k]
        vocab = self.model.config.vocab_size
        return torch.tensor([t if self.wrong_from is None or i < self.wrong_from else (t + 1 + i) % vocab
                             for i, t in enumerate(truth)], dtype=torch.long)


def run_forced(model, prompt, plain, k, wrong_from, inner=None, extra_check=None):
    trajectory = prompt + plain
    state = DecodeState(model, 256, 16, "cpu", torch.float32)
    checked = []

    def check(length):
        if state.length != length or length <= len(prompt) or length >= len(trajectory):  # past it: nothing to compare
            return
        reference = plain_state(model, trajectory[:length])
        for a, b in zip(committed_state(state), committed_state(reference)):
            assert (a - b).abs().max() <= 1e-4, (wrong_from, length)
        if extra_check:
            extra_check(trajectory, length)
        checked.append(length)

    proposer = ForcedProposer(model, trajectory, k, wrong_from, inner, check)
    stats = DecodeStats()
    tokens = list(decode(EagerTarget(model, state, proposer.capture_layers), proposer, prompt, len(plain), set(), 64,
                         stats))
    assert tokens == plain
    assert len(checked) >= 3
    return stats


def plain_greedy(model, prompt, n):
    stats = DecodeStats()
    state = DecodeState(model, 256, 16, "cpu", torch.float32)
    return list(decode(EagerTarget(model, state), Proposer(), prompt, n, set(), 64, stats))


@pytest.fixture(scope="module", params=["mixed", "gdn", "attention"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_target(directory, LAYER_MIXES[request.param], seed=31)
    return load_target(directory)[0]


K = 5


@pytest.mark.parametrize("wrong_from", [None, 0, 1, 2, 3, 4], ids=lambda w: f"wrong_from={w}")
def test_forced_proposals_keep_state_exact(model, wrong_from):
    prompt = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    plain = plain_greedy(model, prompt, 30)
    stats = run_forced(model, prompt, plain, K, wrong_from)
    expected = K if wrong_from is None else wrong_from
    # every full-length cycle accepted exactly the right number of proposals
    full = [a for a, c in zip(stats.accepted_per_cycle, range(stats.cycles))][:-1]
    assert full and all(a == expected for a in full), stats.accepted_per_cycle
