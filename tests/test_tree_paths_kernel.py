"""A draft tree's layout, walk and staging (kernels/tree_paths_triton.py) against their PyTorch references
(kernels/tree_paths.py), through the Triton interpreter in a subprocess: ancestors, conv window rows, the walk's
result and the staged commit inputs and kept feature rows equal, on the drafter's best-first trees (their padding
nodes included), the graph warm-up's star of invalid children, random trees of every shape up to 64 nodes, forced
trees whose siblings repeat a token, and chosen tokens that follow the tree for a while, then leave it; and the
programs compile for sm_90. The CPU's host walk (descend_host) against descend_reference on the same cases."""

import sys

import pytest
import torch
from helpers import (interpreter_part, patch_triton_interpreter, report_parts, run_in_triton_interpreter, selected_parts,
                     sm90_ptx)

from blockspec import kernels
from blockspec.layers.tree import DraftTree
from blockspec.kernels import tree_paths, tree_paths_triton
from blockspec.kernels.drafter_tree import build_tree_reference


def random_tree(size: int, max_depth: int, gen: torch.Generator, repeat_tokens: bool):
    """(tokens, parents, depth, valid) of `size` nodes, parents before children, no node deeper than max_depth."""
    parents, depth = [0], [0]
    for _ in range(1, size):
        shallow = [n for n in range(len(depth)) if depth[n] < max_depth]
        parent = shallow[int(torch.randint(len(shallow), (1,), generator=gen))]
        parents.append(parent)
        depth.append(depth[parent] + 1)
    tokens = torch.randint(0, 3 if repeat_tokens else 1000, (size,), generator=gen)
    valid = torch.rand(size, generator=gen) < 0.9
    valid[0] = True
    return tokens, torch.tensor(parents), torch.tensor(depth), valid


def drafter_tree(budget: int, rows: int, gen: torch.Generator):
    """A best-first tree as the drafter builds it (padding nodes where the candidates run out)."""
    k = 4
    table = torch.log_softmax(torch.randn(rows, k, k, generator=gen) * 2, -1)
    table[torch.rand(rows, k, k, generator=gen) < 0.3] = float("-inf")
    chain = torch.randint(0, k, (rows,), generator=gen)
    candidates = torch.randint(0, 50, (rows, k), generator=gen)
    tree = DraftTree(build_tree_reference(table, candidates, torch.tensor([7]),
                                          candidates[torch.arange(rows), chain], budget))
    return tree.tokens, tree.parents, tree.depth, tree.valid


def chosen_along(tokens, parents, depth, gen: torch.Generator):
    """Tokens chosen at each node: mostly a child's token (so that walks go deep), else a token of no child."""
    chosen = torch.randint(2000, 3000, tokens.shape, generator=gen)
    for node in range(tokens.shape[0]):
        children = [c for c in range(tokens.shape[0]) if c and parents[c] == node]
        if children and torch.rand(1, generator=gen) < 0.85:
            chosen[node] = tokens[children[int(torch.randint(len(children), (1,), generator=gen))]]
    return chosen


def cases():
    gen = torch.Generator().manual_seed(0)
    out = []
    for size, max_depth in [(1, 0), (2, 1), (9, 8), (16, 7), (17, 8), (33, 8), (48, 5), (64, 8), (64, 63), (40, 2)]:
        for repeat in (False, True):
            out.append((f"random {size} depth {max_depth}{' repeats' if repeat else ''}", max_depth,
                        random_tree(size, max_depth, gen, repeat)))
    for budget, rows in [(15, 7), (16, 7), (32, 7), (63, 7), (12, 2)]:
        tree = drafter_tree(budget, rows, gen)
        out.append((f"drafter budget {budget}", rows, tree))
    size = 17  # the graph's warm-up tree: the root and invalid children of it
    zeros = torch.zeros(size, dtype=torch.long)
    out.append(("warm-up star", 7, (zeros, zeros.clone(), (torch.arange(size) > 0).long(), torch.arange(size) == 0)))
    return out


def _mismatches():  # in the interpreter subprocess
    gen = torch.Generator().manual_seed(1)
    results = []
    for name, max_depth, (tokens, parents, depth, valid) in cases():
        differ = []
        for kernel in (2, 4):
            for bound in sorted({max_depth, int(depth.max())}):
                want = tree_paths.layout_reference(parents, depth, kernel, bound)
                got = tree_paths.layout(parents, depth, kernel, bound)
                differ += [f"layout K {kernel} bound {bound} {part}" for part, a, b in
                           zip(("ancestors", "window_rows"), want, got) if not torch.equal(a, b)]
        deepest = 0
        for _ in range(4):
            chosen = chosen_along(tokens, parents, depth, gen)
            want = tree_paths.descend_reference(chosen, tokens, parents, depth, valid, max_depth)
            got = tree_paths.descend(chosen, tokens, parents, depth, valid, max_depth)
            deepest = max(deepest, int(want[0]))
            if not torch.equal(want, got):
                differ.append(f"descend {want.tolist()} != {got.tolist()}")
            differ += staging_mismatches(want, parents, depth, max_depth, gen)
        results.append({"case": name, "differ": differ, "deepest": deepest,
                        "kernel": tree_paths_triton.available(parents)})
    return results


def staging_mismatches(result, parents, depth, max_depth: int, gen: torch.Generator) -> list[str]:
    """stage of a walk's result against its reference: the commit inputs and the kept feature rows, with features
    wider than one program's block and a row stride past their width."""
    window_rows = tree_paths.layout_reference(parents, depth, 4, max(max_depth, 3))[1]
    features = torch.randn(parents.shape[0], 2 * tree_paths_triton.STAGE_BLOCK + 40, generator=gen)[:, :-9]
    start = torch.tensor(int(torch.randint(0, 500, (1,), generator=gen)))
    outputs = []
    for op in (tree_paths.stage_reference, tree_paths.stage):
        buffers = (torch.full((max_depth + 1,), -1), torch.full((3,), -1), torch.tensor(-1))
        kept = op(result, window_rows, features, start, *buffers)
        outputs.append((*buffers, kept))
    names = ("path", "history rows", "start", "kept features")
    return [f"stage {name}" for name, a, b in zip(names, *outputs) if not torch.equal(a, b)]


PARTS = {"test_tree_paths_match_reference_in_interpreter": "cases"}


def test_tree_paths_match_reference_in_interpreter(request):
    results = interpreter_part(run_in_triton_interpreter(__file__, *selected_parts(request, PARTS)), "cases")
    assert [r["case"] for r in results] == [c[0] for c in cases()]
    assert all(r["kernel"] for r in results)
    assert [r for r in results if r["differ"]] == []
    assert max(r["deepest"] for r in results) >= 5  # walks go deep, not only to the root's children


@pytest.mark.skipif(not kernels.TRITON_INSTALLED, reason="needs triton")
def test_tree_paths_compile_for_hopper():
    """The programs compile for sm_90 (the GPU path a tree pass takes; the interpreter above checks their results),
    at a tree of 15 (the GPU's default budget) with programmatic dependent launch, and at the largest pass."""
    layout = {"parents": "*i64", "depth": "*i64", "ancestors": "*u8", "window_rows": "*i64"}
    walk = {"chosen": "*i64", "tokens": "*i64", "parents": "*i64", "depth": "*i64", "valid": "*u8", "out": "*i64"}
    staging = {"result": "*i64", "window_rows": "*i64", "features": "*bf16", "start": "*i64", "path_out": "*i64",
               "history_out": "*i64", "start_out": "*i64", "kept": "*bf16"}
    for nodes, depth, level in ((16, 7, 3), (64, 63, 0)):
        ptx = sm90_ptx(tree_paths_triton._layout_kernel, dict(T=nodes, TAPS=4, MAX_DEPTH=depth, NODES=nodes, PDL=level),
                       4, 1, layout)
        assert ("griddepcontrol.wait" in ptx) == (level > 0)
        ptx = sm90_ptx(tree_paths_triton._descend_kernel, dict(T=nodes, MAX_DEPTH=depth, NODES=nodes, PDL=level), 1, 1,
                       walk)
        assert ".entry _descend_kernel" in ptx
        ptx = sm90_ptx(tree_paths_triton._stage_kernel, dict(ROWS=depth + 1, TAPS=4, ROW_BLOCK=max(2, nodes),
                       TAP_BLOCK=4, BLOCK=tree_paths_triton.STAGE_BLOCK, PDL=level), 4, 3, staging)
        assert ".entry _stage_kernel" in ptx


def test_cpu_takes_the_references():
    assert not tree_paths_triton.available(torch.zeros(4, dtype=torch.long))


def test_host_walk_matches_reference():
    """The CPU's walk (what descend runs there) gives the reference's result on every case, deep walks included."""
    gen = torch.Generator().manual_seed(2)
    deepest = 0
    for name, max_depth, (tokens, parents, depth, valid) in cases():
        for _ in range(4):
            chosen = chosen_along(tokens, parents, depth, gen)
            want = tree_paths.descend_reference(chosen, tokens, parents, depth, valid, max_depth)
            assert torch.equal(tree_paths.descend_host(chosen, tokens, parents, depth, valid, max_depth), want), name
            assert torch.equal(tree_paths.descend(chosen, tokens, parents, depth, valid, max_depth), want), name
            deepest = max(deepest, int(want[0]))
    assert deepest >= 5


if __name__ == "__main__":  # python test_tree_paths_kernel.py PART..., with TRITON_INTERPRET=1
    patch_triton_interpreter()
    report_parts({"cases": _mismatches}, sys.argv[1:])
