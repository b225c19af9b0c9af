"""The draft tree's Triton programs (kernels/drafter_tree_triton.py) against their references, through the Triton
interpreter in a subprocess.
- The best-first build against build_tree_reference: tokens, parents, depth and valid equal, on transition and
  marginal tables, tables of a few values (exact ties everywhere), with -inf and NaN entries, budgets below the rows
  (the chain cut short), at the rows, up to 63, and past what the candidates can fill (padding); a chain token found
  twice in its row.
- The CPU's host build (build_tree_host) against build_tree_reference: the same cases, every shape and style, with
  the padding and the NaN entries exercised.
- The transition table against transition_table_reference, float32: ranks below, at and past a chunk of the dot
  products, one row and many, candidate counts not a power of two.
- A lookup branch grafted on (graft_branch): the program and the host's loop against graft_branch_reference, on
  trees with padding, branches that follow the chain, leave it, follow an off-chain node, are cut short or empty;
  and the grafted tree holds the branch's path once, every other node as it was."""

import sys

import pytest
import torch
from helpers import (interpreter_part, patch_triton_interpreter, report_parts, run_in_triton_interpreter,
                     selected_parts, sm90_ptx)

from blockspec.layers.tree import DraftTree, build_tree
from blockspec.kernels import drafter_tree_triton
from blockspec.kernels.drafter_tree import (build_tree_host, build_tree_reference, graft_branch, graft_branch_host,
                                           graft_branch_reference, transition_table, transition_table_reference)

STYLES = ("transition", "marginal", "ties", "ties_marginal", "masked", "nan")


def budgets(rows: int) -> list[int]:
    return sorted({max(rows - 1, 1), rows, 16, 33, 63})


QUICK = [(16, 16, 63, "ties"), (16, 16, 15, "transition"), (8, 7, 33, "ties_marginal"), (8, 7, 33, "nan"),
         (8, 7, 6, "masked"), (4, 2, 33, "masked"), (4, 1, 16, "ties"), (4, 7, 1, "transition")]
FULL = [(k, rows, budget, style) for k in (8, 16) for rows in (1, 7, 16) for budget in budgets(rows)
        for style in STYLES]


def inputs(k: int, rows: int, style: str, seed: int):
    """(table, candidates, anchor, chain): table [R, K, K] in the given style, the chain the tokens of random
    candidate indices."""
    gen = torch.Generator().manual_seed(seed)
    chain = torch.randint(0, k, (rows,), generator=gen)
    if style.startswith("ties"):  # 4 values, all sums exact: ties between nodes, children, paths
        table = -torch.randint(0, 4, (rows, k, k), generator=gen).float() / 2
        table[(table == 0) & (torch.rand(rows, k, k, generator=gen) < 0.5)] = -0.0
        table[torch.arange(rows), :, chain] = -0.0  # the chain through -0.0 entries (_mismatches)
    else:
        table = torch.log_softmax(torch.randn(rows, k, k, generator=gen) * 2, -1)
    if style.endswith("marginal"):  # the rows' own distributions: the same whatever the pick before
        table = table[:, :1].expand(rows, k, k).contiguous()
    if style in ("masked", "nan"):  # some children impossible, some whole rows of children
        table[torch.rand(rows, k, k, generator=gen) < 0.3] = float("-inf")
        table[torch.rand(rows, k, generator=gen) < 0.2] = float("-inf")
    if style == "nan":  # either sign (x86's -inf - -inf is a negative NaN)
        table[torch.rand(rows, k, k, generator=gen) < 0.03] = float("nan")
        table[torch.rand(rows, k, k, generator=gen) < 0.03] = -float("nan")
    candidates = torch.randint(0, 1000, (rows, k), generator=gen)
    candidates[:, 1] = candidates[:, 0]  # a chain token found twice in its row: the first is its candidate
    return table, candidates, torch.tensor([1000 + seed]), candidates[torch.arange(rows), chain]


def _mismatches(cases):  # in the interpreter subprocess
    """Per case: the outputs of build_tree (the kernel wherever Triton runs) that differ from the reference's (none
    expected), the reference's padding nodes, and whether the kernel took the case."""
    results = []
    for i, (k, rows, budget, style) in enumerate(cases):
        args = inputs(k, rows, style, seed=i)
        want = DraftTree(build_tree_reference(*args, budget))
        got = build_tree(*args, budget)
        differ = sorted({name for name in ("tokens", "parents", "depth", "valid")
                         if not torch.equal(getattr(got, name), getattr(want, name))})
        results.append({"case": [k, rows, budget, style], "differ": differ, "padded": int((~want.valid).sum()),
                        "kernel": drafter_tree_triton.available(args[0], budget)})
    return results


TABLES = [(16, 7, 40), (8, 1, 16), (5, 3, 64), (16, 16, 256)]  # (K, rows, rank)


def table_inputs(k: int, rows: int, rank: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    vocab = 300
    candidates = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(rows)])
    return (torch.randn(rows, k, generator=gen) * 3, candidates, torch.randn(rows, rank, generator=gen),
            torch.tensor([vocab - 1]), torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen))


def _table_errors(cases):  # in the interpreter subprocess
    """Per case: the largest difference of the kernel's table from the reference's, and whether the kernel ran."""
    results = []
    for i, (k, rows, rank) in enumerate(cases):
        args = table_inputs(k, rows, rank, seed=i)
        got, want = transition_table(*args), transition_table_reference(*args)
        results.append({"case": [k, rows, rank], "error": float((got - want).abs().max()),
                        "shape": list(got.shape), "kernel": drafter_tree_triton.table_available(args[0])})
    return results


GRAFTS = [(k, rows, budget, width, style) for k, rows, budget, style in QUICK if budget >= rows
          for width in (1, 3, rows)]


def graft_inputs(k, rows, budget, width, style, seed: int):
    """(nodes, branch): a built tree and a branch of `width` slots whose first tokens follow the chain, an off-chain
    node's path, a padding node or nothing of the tree, how many of them count drawn at random (0 included)."""
    gen = torch.Generator().manual_seed(seed)
    nodes = build_tree_reference(*inputs(k, rows, style, seed), budget)
    valid = (nodes[3] != 0).nonzero().flatten().tolist()
    end = valid[int(torch.randint(0, len(valid), (1,), generator=gen))]  # the branch follows this node's path
    path = []
    while end:
        path.insert(0, int(nodes[0, end]))
        end = int(nodes[1, end])
    tokens = (path + torch.randint(0, 1000, (width,), generator=gen).tolist())[:width]
    padding = (nodes[3] == 0).nonzero().flatten().tolist()
    if padding and seed % 2:  # a padding node's token (a child of the root): never joined, a new node instead
        tokens[0] = int(nodes[0, padding[0]])
    return nodes, torch.tensor(tokens + [int(torch.randint(0, width + 1, (1,), generator=gen))])


# a padding node (3) holds the branch's first token under the root: never joined, so the first token is a new node
# (4) and the second (10, which node 1 holds under the root) a new node under it; the third slot stays padding
PADDED_TREE = torch.tensor([[5, 10, 11, 99], [0, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 0]])
PADDED_BRANCH = torch.tensor([99, 10, 4, 2])
PADDED_GRAFT = torch.tensor([[5, 10, 11, 99, 99, 10, 5], [0, 0, 0, 0, 0, 4, 0], [0, 1, 1, 1, 1, 2, 1],
                             [1, 1, 1, 0, 1, 1, 0]])


def _graft_mismatches(cases):  # in the interpreter subprocess
    results = [{"case": "padded", "differ": not torch.equal(graft_branch(PADDED_TREE, PADDED_BRANCH), PADDED_GRAFT),
                "kernel": drafter_tree_triton.graft_available(PADDED_TREE, PADDED_BRANCH)}]
    for i, case in enumerate(cases):
        nodes, branch = graft_inputs(*case, seed=i)
        results.append({"case": list(case), "differ": not torch.equal(graft_branch(nodes, branch),
                                                                       graft_branch_reference(nodes, branch)),
                        "kernel": drafter_tree_triton.graft_available(nodes, branch)})
    return results


@pytest.fixture(scope="module")
def interpreted(request):
    return run_in_triton_interpreter(__file__, *selected_parts(request, PARTS))


PARTS = {"test_tree_build_matches_reference_in_interpreter": "quick",
         "test_tree_build_every_shape_and_style_in_interpreter": "full",
         "test_transition_table_matches_reference_in_interpreter": "table",
         "test_graft_matches_reference_in_interpreter": "graft"}


def _check(results, cases):
    assert [r["case"] for r in results] == [c if isinstance(c, str) else list(c) for c in cases]
    assert all(r["kernel"] for r in results)
    assert [r for r in results if r["differ"]] == []


def test_tree_build_matches_reference_in_interpreter(interpreted):
    results = interpreter_part(interpreted, "quick")
    _check(results, QUICK)
    assert any(r["padded"] for r in results)  # padding is exercised


@pytest.mark.slow
def test_tree_build_every_shape_and_style_in_interpreter(interpreted):
    _check(interpreter_part(interpreted, "full"), FULL)


def test_transition_table_matches_reference_in_interpreter(interpreted):
    results = interpreter_part(interpreted, "table")
    assert [r["case"] for r in results] == [list(c) for c in TABLES]
    assert all(r["kernel"] and r["shape"] == [r["case"][1], r["case"][0], r["case"][0]] for r in results)
    assert all(r["error"] < 1e-4 for r in results), results


def test_graft_matches_reference_in_interpreter(interpreted):
    _check(interpreter_part(interpreted, "graft"), ["padded", *GRAFTS])


def test_graft_holds_the_branch_once_and_the_tree_as_it_was():
    """The host's graft (the CPU's) equals the reference's; the grafted tree keeps every node of the tree, and the
    branch's tokens are a path from the root, each on the first valid node holding it, new nodes only where the tree
    has none."""
    for graft in (graft_branch_reference, graft_branch_host):
        assert torch.equal(graft(PADDED_TREE, PADDED_BRANCH), PADDED_GRAFT)
    joined = new = 0
    for i, case in enumerate(GRAFTS * 4):
        nodes, branch = graft_inputs(*case, seed=100 + i)
        size, width, count = nodes.shape[1], branch.shape[0] - 1, int(branch[-1])
        grafted = graft_branch_reference(nodes, branch)
        assert torch.equal(graft_branch_host(nodes, branch), grafted), case
        assert torch.equal(grafted[:, :size], nodes) and grafted.shape == (4, size + width)
        tokens, parents, depth, valid = grafted.tolist()
        at = 0
        for token in branch[:count].tolist():
            holding = [n for n in range(1, size + width) if valid[n] and parents[n] == at and tokens[n] == token]
            assert holding and depth[holding[0]] == depth[at] + 1
            joined += holding[0] < size
            at = holding[0]
        extra = [n for n in range(size, size + width) if valid[n]]
        assert all(parents[n] < n for n in extra) and len(extra) <= count
        new += len(extra)
        pairs = [(parents[n], tokens[n]) for n in range(1, size + width) if valid[n]]
        assert len(pairs) - len(set(pairs)) == len([n for n in range(1, size) if valid[n]]) - len(
            {(parents[n], tokens[n]) for n in range(1, size) if valid[n]})  # the graft adds no twin
    assert joined and new


def test_graft_compiles_for_hopper():
    """The graft program compiles for sm_90 (the GPU path; the interpreter above checks its results): a tree of 31
    with its branch of 7 (the GPU's default) under programmatic dependent launch, and a pass of 64 rows without."""
    pytest.importorskip("triton")
    for size, width, level in ((25, 7, 3), (49, 15, 0)):
        ptx = sm90_ptx(drafter_tree_triton._graft_kernel, dict(SIZE=size, WIDTH=width,
                       NODES=drafter_tree_triton.triton.next_power_of_2(size + width), PDL=level), 1, 1,
                       {"nodes": "*i64", "branch": "*i64", "out": "*i64"})
        assert ".entry _graft_kernel" in ptx and ("griddepcontrol.wait" in ptx) == (level > 0)


def test_cpu_takes_the_reference():
    assert not drafter_tree_triton.available(torch.zeros(2, 4, 4), 16)
    assert not drafter_tree_triton.table_available(torch.zeros(2, 4))


def test_host_build_matches_reference():
    """The CPU's build (what build_tree runs there) gives the reference's nodes, in every shape and style."""
    padded = nan = 0
    for i, (k, rows, budget, style) in enumerate(FULL):
        args = inputs(k, rows, style, seed=i)
        want = build_tree_reference(*args, budget)
        assert torch.equal(build_tree_host(*args, budget), want), (k, rows, budget, style)
        assert torch.equal(build_tree(*args, budget).nodes, want)
        padded += int((want[3] == 0).any())
        nan += style == "nan" and bool(args[0].isnan().any())
    assert padded and nan


if __name__ == "__main__":  # python test_tree_build_kernel.py PART..., with TRITON_INTERPRET=1
    patch_triton_interpreter()
    report_parts({"quick": lambda: _mismatches(QUICK), "full": lambda: _mismatches(FULL),
                  "table": lambda: _table_errors(TABLES), "graft": lambda: _graft_mismatches(GRAFTS)}, sys.argv[1:])
