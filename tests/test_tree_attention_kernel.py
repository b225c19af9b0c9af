"""Draft-tree attention's Triton path (kernels/attention_triton.py `tree_attention_triton`, the split-KV kernel's
tree mode) against its reference `tree_attention_sdpa`, through the Triton interpreter in a subprocess, in float32:
random trees of 1..64 nodes, a small head layout and the 27B's grouping (24 query heads over 4 KV heads: 384 rows
at 64 nodes, several row blocks), committed lengths 0 and > 0, several splits, k / v holding NaN past the tree's
last entry (read, it would poison the output); a chain-shaped tree equals the causal reference; `tree_attention`
takes the kernel where Triton runs. And the launch plan: trees of up to MAX_QUERIES nodes launch as chains do."""

import sys

import pytest
import torch
from helpers import interpreter_part, patch_triton_interpreter, report_parts, run_in_triton_interpreter, selected_parts

from blockspec.config import MAX_PASS_TOKENS
from blockspec.kernels.attention import cached_attention_sdpa, tree_attention_sdpa

SMALL = [  # (query heads, kv heads, head dim, nodes, committed length, cache entries past the tree (NaN))
    (4, 2, 16, 1, 0, 7), (4, 2, 16, 9, 37, 20), (4, 2, 16, 33, 0, 300),
    (4, 2, 16, 64, 100, 236),  # 400 entries: 4 splits of 128, the tree's keys across a split boundary; 2 row blocks
    (24, 4, 32, 1, 70, 9), (24, 4, 32, 9, 0, 50), (24, 4, 32, 33, 150, 1),  # the 27B's grouping: 198 rows at 33
]
LARGE = [  # 384 rows: 6 row blocks (the interpreter runs the merge's 4 x 384 programs one by one: ~12 s a case)
    (24, 4, 32, 64, 100, 236), (24, 4, 256, 33, 50, 80),  # the last: the 27B's head dim
]


def tree_ancestors(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: ancestors[i, j] = node j on node i's path (i included), following parents (parents[i] < i)."""
    t = len(parents)
    ancestors = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        ancestors[i] |= ancestors[parents[i]]
    return ancestors


def random_parents(t: int, gen) -> list[int]:
    """Half the nodes continue the node before them (deep paths), the others hang from a random earlier node."""
    return [0] + [i - 1 if torch.rand(1, generator=gen).item() < 0.5 else int(torch.randint(i, (1,), generator=gen))
                  for i in range(1, t)]


def inputs(hq, hkv, d, t, start, past, seed):
    gen = torch.Generator().manual_seed(seed)
    length = start + t + past
    q = torch.randn(t, hq, d, generator=gen)
    k, v = torch.randn(length, hkv, d, generator=gen), torch.randn(length, hkv, d, generator=gen)
    k[start + t:], v[start + t:] = float("nan"), float("nan")  # past the tree: must not be read
    return q, k, v, torch.arange(start, start + t), gen


def _err(got, want) -> float:
    diff = (got - want).abs()
    return float("inf") if bool(diff.isnan().any()) else float(diff.max())


def _tree_cases(cases):  # in the interpreter subprocess
    from blockspec.kernels import attention_triton

    results = []
    for i, (hq, hkv, d, t, start, past) in enumerate(cases):
        q, k, v, slots, gen = inputs(hq, hkv, d, t, start, past, seed=100 * i + t)
        ancestors = tree_ancestors(random_parents(t, gen))
        want = tree_attention_sdpa(q, k[:start + t], v[:start + t], slots, ancestors, d ** -0.5)
        got = attention_triton.tree_attention_triton(q, k, v, slots, ancestors, d ** -0.5)
        plan = attention_triton.launch_plan(t, hq // hkv, k.shape[0], tree=True)
        results.append({"case": [hq, hkv, d, t, start, past], "err": _err(got, want),
                        "splits": plan["splits"], "row_blocks": plan["row_blocks"]})
    return results


def _chain(cases, dispatch: bool):  # in the interpreter subprocess
    from blockspec.kernels import attention_triton
    from blockspec.kernels.attention import tree_attention

    out = []
    for hq, hkv, d, t, start, past in cases:
        q, k, v, slots, _ = inputs(hq, hkv, d, t, start, past, seed=t)
        chain = tree_ancestors(list(range(-1, t - 1)))
        want = cached_attention_sdpa(q, k[:start + t], v[:start + t], slots, d ** -0.5)
        got = attention_triton.tree_attention_triton(q, k, v, slots, chain, d ** -0.5)
        out.append({"chain": _err(got, want)})
        if dispatch:
            out[-1]["dispatch"] = _err(tree_attention(q, k, v, slots, chain, d ** -0.5), got)
    full = torch.zeros(MAX_PASS_TOKENS + 1, 4, 16)
    available = [attention_triton.available(full[:MAX_PASS_TOKENS], tree=True),
                 attention_triton.available(full, tree=True),
                 attention_triton.available(full[:attention_triton.MAX_QUERIES + 1])]
    return {"cases": out, "available": available}


PARTS = {"test_tree_kernel_matches_reference_in_interpreter": "small",
         "test_tree_kernel_27b_rows_in_interpreter": "large",
         "test_chain_shaped_tree_and_dispatch_in_interpreter": "chain",
         "test_chain_shaped_tree_27b_rows_in_interpreter": "large_chain"}


@pytest.fixture(scope="module")
def interpreted(request):
    """The kernel cases of the tests selected, in one interpreter subprocess."""
    return run_in_triton_interpreter(__file__, *selected_parts(request, PARTS))


def _check(results, cases):
    assert [r["case"] for r in results] == [list(c) for c in cases]
    for r in results:
        assert r["err"] < 1e-4, r


def test_tree_kernel_matches_reference_in_interpreter(interpreted):
    results = interpreter_part(interpreted, "small")
    _check(results, SMALL)
    assert max(r["splits"] for r in results) > 1 and max(r["row_blocks"] for r in results) > 1, results


@pytest.mark.slow
def test_tree_kernel_27b_rows_in_interpreter(interpreted):
    results = interpreter_part(interpreted, "large")
    _check(results, LARGE)
    assert results[0]["row_blocks"] == 6, results[0]  # 64 nodes x 6 heads / 64 rows


def test_chain_shaped_tree_and_dispatch_in_interpreter(interpreted):
    out = interpreter_part(interpreted, "chain")
    assert out["cases"][0]["chain"] < 1e-4, out
    assert out["cases"][0]["dispatch"] == 0.0, out  # tree_attention took the kernel
    assert out["available"] == [True, False, False], out


@pytest.mark.slow
def test_chain_shaped_tree_27b_rows_in_interpreter(interpreted):
    out = interpreter_part(interpreted, "large_chain")
    assert out["cases"][0]["chain"] < 1e-4, out


def test_launch_plan_rows_bounded_and_small_trees_launch_as_chains():
    pytest.importorskip("triton")
    from blockspec.kernels.attention_triton import MAX_QUERIES, TREE_ROW_BLOCK, launch_plan

    for capacity in (40, 4096, 32768):
        for group in (1, 2, 4, 6, 8):
            for t in range(1, MAX_PASS_TOKENS + 1):
                plan = launch_plan(t, group, capacity, tree=True)
                assert plan["block_m"] * plan["row_blocks"] >= t * group
                assert plan["block_m"] * (plan["row_blocks"] - 1) < t * group  # no empty row block
                if t <= MAX_QUERIES:
                    assert plan == launch_plan(t, group, capacity), (t, group, capacity)
                else:
                    assert plan["block_m"] <= TREE_ROW_BLOCK


if __name__ == "__main__":  # python test_tree_attention_kernel.py PART..., with TRITON_INTERPRET=1
    patch_triton_interpreter()
    report_parts({"small": lambda: _tree_cases(SMALL), "large": lambda: _tree_cases(LARGE),
                  "chain": lambda: _chain([(4, 2, 16, 9, 30, 40)], dispatch=True),
                  "large_chain": lambda: _chain([(24, 4, 32, 40, 60, 30)], dispatch=False)}, sys.argv[1:])
