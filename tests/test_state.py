"""The decode-state transaction: commit(n) / discard() on attention and DeltaNet layers, chunked prefill, reset."""

import pytest
import torch
from helpers import LAYER_MIXES, run_pass, save_hf_target

from blockspec.models.checkpoint import load_target
from blockspec.engine.decode import Proposer, prefill
from blockspec.engine.state import DecodeState
from blockspec.engine.target import EagerTarget


@pytest.fixture(scope="module", params=["mixed", "gdn", "attention"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_target(directory, LAYER_MIXES[request.param], seed=21)
    return load_target(directory)[0]


def new_state(model):
    return DecodeState(model, 128, 16, "cpu", torch.float32)


def run(model, state, ids):
    out = run_pass(model, state, ids)
    state.commit(ids.shape[0])
    return out.logits


def snapshot(state):
    snap = []
    for s in state.layers:
        if hasattr(s, "recurrent"):
            snap += [s.history.clone(), s.recurrent.clone()]
        else:
            snap += [s.k[:state.length].clone(), s.v[:state.length].clone()]
    return snap


def test_commit_every_n_matches_plain_run(model):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (11,), generator=gen)
    for k in (1, 3, 8):
        block = torch.randint(0, 300, (k,), generator=gen)
        after = torch.randint(0, 300, (4,), generator=gen)
        for n in range(1, k + 1):
            state = new_state(model)
            run(model, state, prompt)
            run_pass(model, state, block)
            state.commit(n)
            assert state.length == 11 + n
            continued = run(model, state, after)
            plain = run(model, new_state(model), torch.cat([prompt, block[:n], after]))[-4:]
            assert (continued - plain).abs().max() <= 1e-4, (k, n)


def test_discard_leaves_state_untouched(model):
    gen = torch.Generator().manual_seed(1)
    prompt, block, after = (torch.randint(0, 300, (m,), generator=gen) for m in (9, 6, 3))
    state = new_state(model)
    run(model, state, prompt)
    before = snapshot(state)
    run_pass(model, state, block)
    state.discard()
    assert state.length == 9
    for a, b in zip(before, snapshot(state)):
        assert torch.equal(a, b)
    plain = run(model, new_state(model), torch.cat([prompt, after]))[-3:]
    assert (run(model, state, after) - plain).abs().max() <= 1e-4


def test_partial_commit_changes_state_differently_per_n(model):
    """Guard against a commit that ignores n: committing 2 vs 5 tokens must give different states."""
    gen = torch.Generator().manual_seed(2)
    prompt, block = torch.randint(0, 300, (5,), generator=gen), torch.randint(0, 300, (6,), generator=gen)
    results = []
    for n in (2, 5):
        state = new_state(model)
        run(model, state, prompt)
        run_pass(model, state, block)
        state.commit(n)
        results.append(run(model, state, torch.tensor([7])))
    assert (results[0] - results[1]).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64])
def test_chunked_prefill_equals_one_shot(model, chunk):
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3))
    one_shot, chunked = new_state(model), new_state(model)
    first = prefill(EagerTarget(model, one_shot), prompt, 0, 64, Proposer())[0]
    assert prefill(EagerTarget(model, chunked), prompt, 0, chunk, Proposer())[0] == first
    for a, b in zip(snapshot(one_shot), snapshot(chunked)):
        assert (a - b).abs().max() <= 1e-4
    nxt = torch.tensor([first])
    assert (run(model, one_shot, nxt) - run(model, chunked, nxt)).abs().max() <= 1e-4


def test_reset_reuses_buffers(model):
    state = new_state(model)
    pointers = [t.data_ptr() for t in snapshot_tensors(state)]
    prompt = torch.randint(0, 300, (10,), generator=torch.Generator().manual_seed(4))
    first = run(model, state, prompt)
    state.reset()
    assert state.length == 0
    assert [t.data_ptr() for t in snapshot_tensors(state)] == pointers
    assert torch.equal(run(model, state, prompt), first)


def snapshot_tensors(state):
    return [t for s in state.layers for t in ((s.history, s.recurrent) if hasattr(s, "recurrent") else (s.k, s.v))]


def test_commit_bounds_are_checked(model):
    state = new_state(model)
    run_pass(model, state, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError):
        state.commit(4)
    with pytest.raises(ValueError):
        state.commit(0)


def test_in_place_state_equals_transactional_and_refuses_partial_commits(model):
    """Plain decoding's in-place DeltaNet state (recurrent state and, for one-token passes, the conv history
    updated by the pass itself): token by token it ends in exactly the transactional state."""
    gen = torch.Generator().manual_seed(5)
    prompt, tokens = torch.randint(0, 300, (7,), generator=gen), torch.randint(0, 300, (5,), generator=gen)
    states = [new_state(model), DecodeState(model, 128, 16, "cpu", torch.float32, in_place=True)]
    logits = []
    for state in states:
        run(model, state, prompt)
        logits.append(torch.stack([run(model, state, tokens[i:i + 1])[0] for i in range(5)]))
    assert torch.equal(logits[0], logits[1])
    assert all(torch.equal(a, b) for a, b in zip(snapshot(states[0]), snapshot(states[1])))
    if states[1].gdn:  # one-token in-place passes shift the history themselves: their commit is bookkeeping only
        assert not states[1].commit_moves_data(1, 1) and states[1].commit_moves_data(3, 3)
        assert states[0].commit_moves_data(1, 1)
        run_pass(model, states[1], tokens[:3])
        with pytest.raises(RuntimeError, match="in-place"):
            states[1].commit(2)
