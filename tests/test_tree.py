"""Draft trees: the layout of a tree pass, the drafter's tree, the walk, the kept path, and DFlash2 with trees equal to
plain greedy decoding token for token (float32, CPU), at every budget, including trees the candidates fill whole."""

import itertools
import json
import shutil

import pytest
import torch
from helpers import cli, run_pass

from blockspec.layers.tree import DraftTree, build_tree, transition_log_probs
from blockspec.config import DEFAULT_TREE_BUDGETS, SamplingSettings
from blockspec.engine.engine import Engine
from blockspec.engine.sampling import Sampler, speculative_accept
from blockspec.engine.state import DecodeState
from blockspec.engine.sampling import walk
from blockspec.layers.tree import TreeLayout


def random_parents(t: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([0] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)])


def path_of(parents: list[int], node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("t,seed", [(1, 0), (2, 0), (9, 1), (33, 2), (64, 3)])
def test_layout_follows_each_nodes_path(t, seed):
    parents = random_parents(t, seed)
    paths = [path_of(parents.tolist(), i) for i in range(t)]
    depth = torch.tensor([len(p) - 1 for p in paths])
    kernel, start = 4, 5
    layout = TreeLayout.build(parents, depth, start, kernel)
    for i, path in enumerate(paths):
        assert set(layout.ancestors[i].nonzero().flatten().tolist()) == set(path)
        # the conv's rows: the history's last rows, then the path's nodes, the node itself last
        rows = [kernel - 1 + n for n in path][-kernel:]
        rows = list(range(kernel - 1 - (kernel - len(rows)), kernel - 1)) + rows
        assert layout.window_rows[i].tolist() == rows
    assert layout.positions.tolist() == (start + depth).tolist()
    assert layout.slots.tolist() == list(range(start, start + t))


def all_paths(table, candidates, anchor):
    """{(candidate indices...): path log-probability} of every path of the candidate tree (brute force)."""
    rows, k = candidates.shape
    scores = {}
    for length in range(1, rows + 1):
        for picks in itertools.product(range(k), repeat=length):
            before = [0] + list(picks[:-1])
            scores[picks] = sum(float(table[r, before[r], picks[r]]) for r in range(length))
    return scores


@pytest.mark.parametrize("budget", [1, 3, 5, 10, 20, 39, 45])
def test_tree_is_the_chain_then_the_best_paths(budget):
    """The tree holds the greedy chain, then the highest-scoring other paths (scores fall along a path, so
    best-first takes the global best); past the K + K^2 + K^3 = 39 paths it is padded with invalid nodes."""
    rows, k, vocab, rank = 3, 3, 50, 4
    gen = torch.Generator().manual_seed(budget)
    unary = torch.randn(rows, k, generator=gen)
    candidates = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(rows)])
    projected = torch.randn(rows, rank, generator=gen)
    predecessor, successor = torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen)
    anchor = torch.tensor([7])
    table = transition_log_probs(unary, candidates, projected, anchor, predecessor, successor)
    chain = torch.tensor([1, 0, 2])
    tree = build_tree(table, candidates, anchor, candidates[torch.arange(rows), chain], budget)
    parents, depth, tokens, valid = (x.tolist() for x in (tree.parents, tree.depth, tree.tokens, tree.valid))
    # each node's candidate indices from the root, recovered from the tokens
    picks = {0: ()}
    for i in range(1, budget + 1):
        assert parents[i] < i and depth[i] == depth[parents[i]] + 1
        if valid[i]:
            picks[i] = picks[parents[i]] + (candidates[depth[i] - 1].tolist().index(tokens[i]),)
    chain_paths = {tuple(chain[:n].tolist()) for n in range(1, min(budget, rows) + 1)}
    nodes = {picks[i] for i in range(1, budget + 1) if valid[i]}
    assert chain_paths <= nodes and len(nodes) == sum(valid) - 1  # no path twice
    scores = all_paths(table, candidates, anchor)
    others = sorted((p for p in scores if p not in chain_paths), key=scores.get, reverse=True)
    assert nodes - chain_paths == set(others[:budget - len(chain_paths)])
    assert sum(valid) - 1 == min(budget, len(scores))
    # each row's transition distribution given the pick before it is the selector's score, softmaxed
    query = predecessor[candidates[0, 1]] * projected[1]
    expected = torch.log_softmax(unary[1] + successor[candidates[1]] @ query, -1)
    torch.testing.assert_close(table[1, 1], expected)


def test_walk_follows_the_targets_choices():
    #          0
    #        1   2        node: token
    #      3  4    5      1: 10, 2: 11, 3: 20, 4: 21, 5: 20, 6: 30
    #      6
    tree = DraftTree.of(torch.tensor([5, 10, 11, 20, 21, 20, 30]), torch.tensor([0, 0, 0, 1, 1, 2, 3]),
                        torch.tensor([0, 1, 1, 2, 2, 2, 3]), torch.ones(7, dtype=torch.bool))
    vocab = 40

    def choices(tokens):  # logits whose argmax at node i is tokens[i]
        return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()

    result = walk(choices([11, 0, 20, 0, 0, 7, 0]), tree, 3).tolist()
    assert result[:2] == [2, 7] and result[2:5] == [0, 2, 5] and result[6:9] == [5, 11, 20]
    result = walk(choices([10, 21, 0, 0, 3, 0, 0]), tree, 3).tolist()
    assert result[:2] == [2, 3] and result[2:5] == [0, 1, 4]
    assert walk(choices([12, 0, 0, 0, 0, 0, 0]), tree, 3).tolist()[:3] == [0, 12, 0]
    tree.nodes[3, 2] = 0  # padding is never entered
    assert walk(choices([11, 0, 20, 0, 0, 7, 0]), tree, 3).tolist()[:2] == [0, 11]


def test_sampled_walk_accepts_what_the_chain_accepts_and_more():
    """Under sampling, with the same uniforms, the tree walk's tests of its chain are the chain verification's
    (engine/sampling.py speculative_accept): it accepts at least the chain's proposals on every draw, and more where
    a rejected proposal's residual draw is one of the node's other children."""
    #          0
    #        1   4        chain: 1, 2, 3 (tokens 3, 5, 7); others: 4 (token 4), 5 (token 6), 6 (token 8)
    #      2   5
    #      3  6
    tree = DraftTree.of(torch.tensor([0, 3, 5, 7, 4, 6, 8]), torch.tensor([0, 0, 1, 2, 0, 1, 5]),
                        torch.tensor([0, 1, 2, 3, 1, 2, 3]), torch.ones(7, dtype=torch.bool))
    sampler = Sampler("cpu")
    sampler.begin(SamplingSettings(temperature=1.0))
    gen = torch.Generator().manual_seed(0)
    more = 0
    for _ in range(300):
        logits = 2 * torch.randn(7, 10, generator=gen)
        candidates = torch.tensor([[3, 4, 1, 2], [5, 6, 0, 1], [7, 8, 0, 2]])
        q = torch.softmax(torch.randn(3, 4, generator=gen), -1)
        uniforms = 1 - torch.rand(8, generator=gen, dtype=torch.float64)
        chain_rows = torch.tensor([0, 1, 2, 3])
        chain = speculative_accept(logits[chain_rows], tree.tokens[chain_rows], candidates, q, uniforms[:4],
                                   sampler.filters())
        result = walk(logits, tree, 3, uniforms, (candidates, q), sampler.filters(), sampler.width())
        accepted, chain_accepted = int(result[0]), int(chain[0])
        assert accepted >= chain_accepted
        assert result[2:3 + chain_accepted].tolist() == list(range(chain_accepted + 1))
        more += accepted > chain_accepted
    assert more > 10


def load(target, drafter=None, budget=0, **kw):
    return Engine.load(target, device="cpu", compute_dtype="float32", context_length=512,
                       mode="dflash2" if drafter else "none", dflash2_model=str(drafter) if drafter else None,
                       dflash2_tree_budget=budget, **kw)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tiny_drafter):
    target = tiny_checkpoint(seed=0, planted=True)
    return target, tiny_drafter(target, window=16, noise=1.0)


@pytest.fixture(scope="module")
def small_drafter(pair, tmp_path_factory):
    """The pair's drafter with 3 proposals of 2 candidates each: 2 + 4 + 8 = 14 paths, so budgets from 14 fill
    the tree whole (and pad it)."""
    directory = tmp_path_factory.mktemp("small") / "drafter"
    shutil.copytree(pair[1], directory)
    config = json.loads((directory / "config.json").read_text())
    config["dflash_config"].update(block_size=4, selector_top_k=2)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def references(pair):
    """Plain greedy and chain DFlash2 output of the pair (150 tokens), computed once."""
    target, drafter = pair
    plain_engine = load(target)
    ids = plain_engine.tokenizer.encode("hello world")
    return ids, plain_engine.generate(ids, 150, stop_at_eos=False), load(target, drafter).generate(
        ids, 150, stop_at_eos=False)


@pytest.mark.parametrize("budget", [1, 7, 16, 63])
def test_tree_decoding_equals_plain_greedy(pair, references, budget):
    target, drafter = pair
    ids, plain, chain = references
    tree = load(target, drafter, budget).generate(ids, 150, stop_at_eos=False)
    print(f"budget {budget}: mean accepted length {tree.stats['mean_accepted_length']} (chain "
          f"{chain.stats['mean_accepted_length']}), nodes per cycle {tree.stats['nodes_per_cycle']}")
    assert tree.tokens == plain.tokens == chain.tokens
    assert tree.stats["tree_budget"] == budget and tree.stats["nodes_per_cycle"] > 0
    if budget >= 16:
        assert tree.stats["mean_accepted_length"] > chain.stats["mean_accepted_length"]
        assert set(tree.stats["accepted_per_cycle"]) & {0, 7} and set(tree.stats["accepted_per_cycle"]) & {1, 2, 3}


@pytest.mark.parametrize("budget,lookup", [(8, 1), (14, 7), (20, 4)])
def test_lookup_branch_decoding_equals_plain_greedy(pair, budget, lookup):
    """With the last `lookup` nodes a branch copied from the context (layers/tree.py ContextLookup), on a prompt
    that repeats itself: output equals plain greedy, and cycles accept paths through the branch's own nodes."""
    target, drafter = pair
    engine = load(target, drafter, budget, dflash2_tree_lookup=lookup)
    ids = engine.tokenizer.encode("the cat sat on the mat. " * 6)
    through = []  # per cycle, whether the kept path holds a node of the branch's slots
    run_tree = engine.target.run_tree

    def recording(tree, depth, *args):
        features, result = run_tree(tree, depth, *args)
        path = result[2:3 + int(result[0])].tolist()
        through.append(any(node > budget - lookup for node in path))
        return features, result
    engine.target.run_tree = recording
    result = engine.generate(ids, 80, stop_at_eos=False)
    assert result.tokens == load(target).generate(ids, 80, stop_at_eos=False).tokens
    assert result.stats["tree_budget"] == budget and len(through) == result.stats["cycles"]
    assert any(through), through


@pytest.mark.parametrize("budget", [5, 14, 20])
def test_trees_filled_whole_equal_plain_greedy(pair, small_drafter, budget):
    target, _ = pair
    ids = load(target).tokenizer.encode("abc")
    plain = load(target).generate(ids, 60, stop_at_eos=False)
    engine = load(target, small_drafter, budget, dflash2_tree_lookup=0)  # the drafter's nodes alone
    result = engine.generate(ids, 60, stop_at_eos=False)
    assert result.tokens == plain.tokens
    padded = engine.proposer.propose_tree(ids[-1], engine.state.length)  # the last request's context: any will do
    assert int(padded.valid.sum()) - 1 == min(budget, 14)


def test_kept_path_equals_a_pass_over_it(pair):
    """After a tree pass and commit_path, the state (KV entries, DeltaNet conv histories and recurrent states)
    equals the state after one plain pass over the path's tokens."""
    target, drafter = pair
    engine = load(target, drafter, 20)
    model, state = engine.model, engine.state
    prompt = engine.tokenizer.encode("hello world")
    run_pass(model, state, torch.tensor(prompt[:-1]))
    state.commit(len(prompt) - 1)
    engine.proposer.observe(run_pass(model, DecodeState(model, 512, 64, "cpu", torch.float32),
                                     torch.tensor(prompt[:-1]), engine.proposer.capture_layers),
                            0, prompt[:-1], prompt[1:])
    tree = engine.proposer.propose_tree(prompt[-1], len(prompt) - 1)
    start = state.begin(tree.size)  # the tree pass as EagerTarget.run_tree runs it, staging the deepest node's path
    layout = TreeLayout.build(tree.parents, tree.depth, start, model.config.linear_conv_kernel_dim)
    out = model(tree.tokens, state.layers, start=start, capture=engine.proposer.capture_layers, tree=layout)
    node = int(tree.depth.argmax())
    path = path_of(tree.parents.tolist(), node)
    walked = torch.tensor([len(path) - 1, 0, *path, *tree.tokens[path].tolist()])  # a walk's result down to node
    features = state.stage_path(start, layout.window_rows, out.features, walked, len(path))
    state.commit_path(len(path))
    assert torch.equal(features, out.features[path])
    fresh = DecodeState(model, 512, 64, "cpu", torch.float32)
    run_pass(model, fresh, torch.tensor(prompt[:-1]))
    fresh.commit(len(prompt) - 1)
    chain_out = run_pass(model, fresh, tree.tokens[path])
    fresh.commit(len(path))
    assert len(path) == 8 and state.length == fresh.length == len(prompt) - 1 + len(path)
    torch.testing.assert_close(out.logits[path], chain_out.logits, rtol=1e-5, atol=1e-5)
    for kept, expected in zip(state.layers, fresh.layers):
        if hasattr(kept, "k"):
            torch.testing.assert_close(kept.k[:state.length], expected.k[:state.length])
            torch.testing.assert_close(kept.v[:state.length], expected.v[:state.length])
        else:
            torch.testing.assert_close(kept.history, expected.history)
            torch.testing.assert_close(kept.recurrent, expected.recurrent, rtol=1e-5, atol=1e-6)


def test_the_default_budget_is_the_device_s(pair):
    """Unset, the budget is the device's measured best, a tree of 15 on the CPU and of 31 on a GPU (device auto: the
    one it runs on); set, it is kept; the other modes verify no tree."""
    target, drafter = pair
    engine = load(target, drafter, budget=None)
    assert engine.proposer.tree_budget == DEFAULT_TREE_BUDGETS["cpu"] == 15
    config = engine.config
    assert config.dflash2_tree_budget is None and config.tree_budget == 15
    assert config.model_copy(update={"device": "cuda"}).tree_budget == DEFAULT_TREE_BUDGETS["cuda"] == 31
    auto = config.model_copy(update={"device": "auto"}).tree_budget
    assert auto == (31 if torch.cuda.is_available() else 15)
    assert config.model_copy(update={"dflash2_tree_budget": 0, "device": "cuda"}).tree_budget == 0
    assert config.model_copy(update={"mode": "mtp", "dflash2_model": None}).tree_budget == 0
    prompt = engine.tokenizer.encode("hello world")
    result = engine.generate(prompt, 24, stop_at_eos=False)
    assert result.stats["tree_budget"] == 15
    assert result.tokens == load(target).generate(prompt, 24, stop_at_eos=False).tokens


@pytest.mark.parametrize("budget,lookup,expected", [(None, None, 7), (8, None, 1), (7, None, 0), (1, None, 0),
                                                     (0, None, 0), (20, None, 7), (15, 0, 0), (14, 7, 7)])
def test_the_default_lookup_fits_the_budget(pair, budget, lookup, expected):
    """Unset, a tree's lookup branch is DEFAULT_TREE_LOOKUP's 7 nodes, cut to what the budget leaves beyond the
    drafter's chain of 7 (never refused); set, it is kept."""
    target, drafter = pair
    engine = load(target, drafter, budget, **({} if lookup is None else {"dflash2_tree_lookup": lookup}))
    assert engine.proposer.tree_lookup == expected
    prompt = engine.tokenizer.encode("the cat sat on the mat. " * 3)
    stats = engine.generate(prompt, 12, stop_at_eos=False).stats
    assert stats.get("tree_lookup", 0) == expected


@pytest.mark.parametrize("args,needle", [
    (["--mode", "mtp", "--tree-budget", "8"], "dflash2_tree_budget: 8 verifies trees of DFlash2 proposals, but mode "
                                               "is 'mtp'"),
    (["--tree-budget", "8"], "but mode is 'none'"),
    (["--tree-budget", "64"], "'dflash2_tree_budget': Input should be less than or equal to 63 (got 64)"),
    (["--tree-budget", "-1"], "'dflash2_tree_budget': Input should be greater than or equal to 0 (got -1)"),
])
def test_bad_budgets_are_refused_in_one_line(pair, args, needle):
    target, _ = pair
    code, _, err = cli("generate", "--model", str(target), "--prompt", "abc", "--device", "cpu", *args)
    err = err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args,needle", [
    (["--mode", "mtp", "--tree-lookup", "4"], "dflash2_tree_lookup: 4 gives nodes of a DFlash2 draft tree to a branch "
                                              "from the context, but mode is 'mtp': set it to 0"),
    (["DRAFTER", "--tree-budget", "0", "--tree-lookup", "2"], "but dflash2_tree_budget is 0 (no tree)"),
    (["DRAFTER", "--tree-budget", "9", "--tree-lookup", "4"], "dflash2_tree_lookup: 4 leaves 5 of dflash2_tree_budget "
                                                              "9's nodes to the drafter, fewer than its chain of 7"),
    (["DRAFTER", "--tree-budget", "30", "--tree-lookup", "9"], "dflash2_tree_lookup: 9 exceeds the drafter's 7 "
                                                               "proposals a block"),
    (["DRAFTER", "--tree-lookup", "16"], "'dflash2_tree_lookup': Input should be less than or equal to 15 (got 16)"),
    (["DRAFTER", "--tree-lookup", "-1"], "'dflash2_tree_lookup': Input should be greater than or equal to 0"),
])
def test_bad_lookups_are_refused_in_one_line(pair, args, needle):
    target, drafter = pair
    args = [a for arg in args for a in (["--drafter", str(drafter)] if arg == "DRAFTER" else [arg])]
    code, _, err = cli("generate", "--model", str(target), "--prompt", "abc", "--device", "cpu", *args)
    err = err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err
