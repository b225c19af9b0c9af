"""The DeltaNet mixer of a draft-tree pass (kernels/gdn_triton.py `tree_pass`: the tree conv, then the recurrence
solved in closed form under ancestor masks) against its reference (the tree conv, per-node recurrence from the
parent's state, gated norm of kernels/gdn.py), through the Triton interpreter in a subprocess: random trees, the
drafter's shape (its chain, then shallow nodes) at 1..64 nodes, a comb (a chain first, then a leaf on each chain
node), a chain (also equal to the chain's reference), gates computed and stored or given; out, window, conv output,
gates, and the committed state untouched; each with the tightest depth bound, so a closed form with a product too
few fails. Outputs the kernel allocates start as NaN: a row no program writes fails. And the reference itself,
independently: each node's output is the chain reference run over that node's path alone."""

import sys

import pytest
import torch
from helpers import interpreter_part, patch_triton_interpreter, report_parts, run_in_triton_interpreter, selected_parts

from blockspec import kernels
from blockspec.kernels import gdn
from blockspec.kernels.gdn_gates import GateProjections, Gates, deltanet_gates
from blockspec.kernels.norm import gated_rms_norm_reference
from blockspec.layers.tree import TreeLayout

TAPS = 4
SMALL = [  # (key heads, key dim, value heads, value dim, nodes, tree, BLOCK_V, gates); 32 over 16: two slices
    (2, 16, 4, 16, 1, "random", 16, "ab"), (2, 16, 4, 32, 8, "random", 64, "ab"),
    (2, 16, 4, 16, 8, "random", 16, "given"), (2, 16, 4, 32, 12, "chain", 16, "ab"),
    (2, 16, 4, 16, 33, "random", 16, "ab"),
]
LARGE = [  # a comb 16 deep; the 27B's grouping (3 value heads a key head) with dims that are not powers of two; key
    # channels in two loads (the second part-masked)
    (2, 16, 4, 16, 33, "comb", 16, "ab"), (2, 24, 6, 20, 17, "random", 16, "ab"),
    (1, 48, 2, 16, 24, "drafted", 16, "ab"),
]
TREES = [  # 1..64 nodes: the drafter's shape (depth <= 8), a 20-deep chain, a deep random tree; two value slices
    (1, 16, 2, 32, t, kind, 16, "ab") for t, kind in [
        (1, "drafted"), (2, "drafted"), (3, "drafted"), (5, "drafted"), (9, "drafted"), (17, "drafted"),
        (33, "drafted"), (64, "drafted"), (20, "chain"), (28, "random")]
]


def tree_parents(kind: str, t: int, gen) -> torch.Tensor:
    """parents [T] int64 (parents[i] < i, the root's 0): random (half the nodes continue the node before them, so
    that paths run deep), drafted (the drafter's chain 0..8, then parents of depth < 8 drawn with weight 2^-depth), a
    chain, or a comb (chain 0..t//2, then a leaf on each of its nodes, in order)."""
    if kind == "chain":
        return torch.arange(t).clamp(min=1) - 1
    if kind == "comb":
        spine = t // 2 + 1
        return torch.cat([torch.arange(spine).clamp(min=1) - 1, torch.arange(t - spine)])
    if kind == "drafted":
        parents = (torch.arange(min(t, 9)).clamp(min=1) - 1).tolist()
        depth = list(range(len(parents)))
        while len(parents) < t:
            weights = torch.tensor([0.5 ** d if d < 8 else 0.0 for d in depth])
            parents.append(int(torch.multinomial(weights, 1, generator=gen)))
            depth.append(depth[parents[-1]] + 1)
        return torch.tensor(parents)
    parents = [0] * t
    for i in range(1, t):
        parents[i] = i - 1 if torch.rand(1, generator=gen).item() < 0.5 else int(torch.randint(i, (1,), generator=gen))
    return torch.tensor(parents)


def layout(parents: torch.Tensor) -> TreeLayout:
    """The tree's layout, its depth bound the deepest node's depth (the tightest the kernel's closed form takes)."""
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[0]):
        depth[i] = depth[parents[i]] + 1
    return TreeLayout.build(parents, depth, 0, TAPS, int(depth.max()))


def inputs(hk, dk, hv, dv, t, seed):
    """A layer's tree-pass inputs as the layer passes them (x, z, b, a strided views of one projection)."""
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    packed = torch.randn(t, channels + hv * dv + 2 * hv + 3, generator=gen)
    x, z = packed[:, :channels], packed[:, channels:channels + hv * dv].view(t, hv, dv)
    b, a = packed[:, channels + hv * dv:channels + hv * dv + hv] * 3, packed[:, -hv - 3:-3] * 3
    history = torch.randn(TAPS - 1, channels, generator=gen)
    conv_w = torch.randn(channels, 1, TAPS, generator=gen) * 0.5
    gates = GateProjections(b, a, torch.randn(hv, generator=gen), torch.randn(hv, generator=gen))
    return dict(x=x, history=history, conv_weight=conv_w, gates=gates, state=torch.randn(hv, dk, dv, generator=gen),
                shape=(hk, dk, hv, dv), z=z, norm_weight=torch.randn(dv, generator=gen) * 0.1 + 1, eps=1e-6), gen


def reference(args, rows, parents):
    """The reference chain of deltanet_tree_mixer, whatever the dispatch: (out, window, mixed, g, beta, deltas)."""
    mixed, window = gdn.causal_conv1d_tree_reference(args["x"], args["history"], args["conv_weight"], rows)
    gates = args["gates"]
    g, beta = deltanet_gates.reference(gates.b, gates.a, gates.A_log, gates.dt_bias)
    out, deltas = gdn.gated_delta_tree_reference(*gdn.deltanet_qkv.reference(mixed, *args["shape"]), g, beta,
                                                 args["state"], parents)
    out = gated_rms_norm_reference.reference(out.to(args["x"].dtype), args["z"], args["norm_weight"], args["eps"])
    return out, window, mixed, g, beta, deltas


def chain_reference(args, nodes=None):
    """The chain's reference (conv, gated delta rule, gated norm) over the nodes `nodes` (default all) in order."""
    nodes = torch.arange(args["x"].shape[0]) if nodes is None else nodes
    mixed, _ = gdn.causal_conv1d_reference.reference(args["x"][nodes], args["history"], args["conv_weight"])
    gates = args["gates"]
    g, beta = deltanet_gates.reference(gates.b[nodes], gates.a[nodes], gates.A_log, gates.dt_bias)
    out, _ = gdn.gated_delta_rule_reference(*gdn.deltanet_qkv.reference(mixed, *args["shape"]), g, beta,
                                            args["state"])
    return gated_rms_norm_reference.reference(out, args["z"][nodes], args["norm_weight"], args["eps"])


def _err(got, want) -> float:
    """Largest absolute difference; infinite where got holds a NaN (an unwritten element of a NaN-filled buffer)."""
    diff = (got - want).abs()
    return float("inf") if bool(diff.isnan().any()) else float(diff.max())


class _NaNEmpty:
    """`torch` as gdn_triton sees it in these tests: torch.empty fills with NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kwargs):
        return torch.full(size, float("nan"), **kwargs)


def _kernel_cases(cases):  # in the interpreter subprocess
    from unittest import mock

    from blockspec.kernels import gdn_triton

    results = []
    for i, (hk, dk, hv, dv, t, kind, block_v, gate_kind) in enumerate(cases):
        args, gen = inputs(hk, dk, hv, dv, t, seed=100 * i + t)
        parents = tree_parents(kind, t, gen)
        tree = layout(parents)
        rows = tree.window_rows
        ref_out, ref_window, ref_mixed, ref_g, ref_beta, ref_deltas = reference(args, rows, parents)
        committed = args["state"].clone()
        window, mixed = torch.full_like(ref_window, float("nan")), torch.full_like(ref_mixed, float("nan"))
        deltas = torch.full_like(ref_deltas, float("nan"))
        g_buf, beta_buf = torch.full((t, hv), float("nan")), torch.full((t, hv), float("nan"))
        if gate_kind == "given":
            args["gates"] = Gates(ref_g, ref_beta)
            g_buf, beta_buf = ref_g, ref_beta
        with mock.patch.object(gdn_triton, "torch", _NaNEmpty()):
            out, returned = gdn_triton.tree_pass(**args, window_rows=rows, ancestors=tree.ancestors,
                                                 max_depth=tree.max_depth, window_out=window,
                                                 mixed_out=mixed, deltas_out=deltas,
                                                 gates_out=(g_buf, beta_buf) if gate_kind == "ab" else None,
                                                 block_v=block_v)
        r = {"case": [hk, dk, hv, dv, t, kind, block_v, gate_kind], "out": _err(out, ref_out),
             "window": _err(window, ref_window), "mixed": _err(mixed, ref_mixed), "deltas": _err(deltas, ref_deltas),
             "gates": max(_err(g_buf, ref_g), _err(beta_buf, ref_beta)),
             "state_untouched": bool(torch.equal(args["state"], committed)), "window_returned": returned is window,
             "counters_clean": int(kernels._COUNTERS[("cpu", None)].abs().sum()) == 0}
        if kind == "chain":
            r["chain"] = _err(out, chain_reference(args))
        if i == 1 and cases is SMALL:  # deltanet_tree_mixer takes the kernel wherever Triton runs
            r["dispatched"] = _err(gdn.deltanet_tree_mixer(**args, tree=tree)[0], out)
        results.append(r)
    return results


def _bench_dry_run():  # in the interpreter subprocess: bench/gdn_kernel.py's tree part, untimed, on tiny shapes
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))  # its `timing` import
    spec = importlib.util.spec_from_file_location("gdn_kernel", bench / "gdn_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reported = {}

    def report(key, us, err, extra=""):
        reported[key] = err

    # value dim 32: with BV 16 two value slices a head, so the last-arriving slice norms the others' rows
    module.trees(report, torch.device("cpu"), torch.float32, shape=(1, 16, 2, 32), layers=1, sizes=(9, 17),
                 configs=((16, 4, "tf32x3", 16), (32, 4, "tf32", 32)), path_configs=((16, 2), (32, 4)), timed=False)
    return reported


@pytest.fixture(scope="module")
def interpreted(request):
    """The kernel cases of the tests selected, in one interpreter subprocess."""
    return run_in_triton_interpreter(__file__, *selected_parts(request, PARTS))


PARTS = {"test_tree_pass_matches_reference_in_interpreter": "small",
         "test_tree_pass_large_trees_in_interpreter": "large",
         "test_tree_pass_over_trees_of_1_to_64_nodes_in_interpreter": "trees",
         "test_bench_tree_part_dry_run_in_interpreter": "bench"}


def _check(results, cases):
    assert [r["case"] for r in results] == [list(c) for c in cases]
    for r in results:  # NaN-filled buffers: an element the kernel forgets to write fails here
        assert max(r["out"], r["window"], r["mixed"], r["gates"], r["deltas"], r.get("chain", 0.0)) < 1e-4, r
        assert r["state_untouched"] and r["window_returned"] and r["counters_clean"], r


def test_tree_pass_matches_reference_in_interpreter(interpreted):
    results = interpreter_part(interpreted, "small")
    _check(results, SMALL)
    assert results[1]["dispatched"] == 0.0, results[1]


@pytest.mark.slow
def test_tree_pass_large_trees_in_interpreter(interpreted):
    _check(interpreter_part(interpreted, "large"), LARGE)


@pytest.mark.slow
def test_tree_pass_over_trees_of_1_to_64_nodes_in_interpreter(interpreted):
    """The closed form against the reference over trees of 1..64 nodes, shallow and deep."""
    _check(interpreter_part(interpreted, "trees"), TREES)


@pytest.mark.slow
def test_bench_tree_part_dry_run_in_interpreter(interpreted):
    """bench/gdn_kernel.py --parts tree (the H200's measurement) on tiny shapes, untimed: its trees, inputs and
    reference check run, each config agrees with the reference, and so does keep_path of the root and of the
    deepest path (the drafted trees' chain of 9 nodes, the comb of 17: its spine of 9), a launch a layer and the
    layers' buffers stacked, each config of the kept path."""
    reported = interpreter_part(interpreted, "bench")
    def configs(t, kind):
        return ("16 warps=2", "32 warps=4") if (t, kind) == (17, "drafted") else ("16 warps=2",)
    assert list(reported) == [key for t, kind in [(9, "drafted"), (17, "drafted"), (17, "comb")]
                              for key in [f"T={t} {kind} tree BLOCK_V=16 warps=4 tf32x3 BLOCK_K=16",
                                          f"T={t} {kind} tree BLOCK_V=32 warps=4 tf32 BLOCK_K=32",
                                          *[key for n in (1, 9) for key in [
                                              *[f"T={t} {kind} keep_path of {n} nodes BLOCK_V={config}"
                                                for config in configs(t, kind)],
                                              *[f"T={t} {kind} keep_path of {n} nodes, the 1 layers in one launch "
                                                f"BLOCK_V={config}" for config in configs(t, kind)]]]]
                              ], reported
    assert all(err < 1e-4 for err in reported.values()), reported


@pytest.mark.parametrize("kind,t", [("random", 9), ("random", 33), ("comb", 17), ("chain", 6)])
def test_tree_reference_is_the_chain_along_each_path(kind, t):
    """deltanet_tree_mixer on the CPU (the reference): node i's output is the chain reference over the path root ..
    i alone; its window is [history; x] and the committed state is untouched."""
    args, gen = inputs(2, 16, 6, 12, t, seed=t)
    parents = tree_parents(kind, t, gen)
    committed = args["state"].clone()
    out, window = gdn.deltanet_tree_mixer(**args, tree=layout(parents))
    for i in range(t):
        path = [i]
        while path[-1] != 0:
            path.append(int(parents[path[-1]]))
        assert _err(out[i], chain_reference(args, torch.tensor(path[::-1]))[-1]) < 1e-5, (kind, i, path)
    assert torch.equal(window, torch.cat([args["history"], args["x"]])) and torch.equal(args["state"], committed)


if __name__ == "__main__":  # python test_tree_gdn_kernel.py PART..., with TRITON_INTERPRET=1
    patch_triton_interpreter()
    report_parts({"small": lambda: _kernel_cases(SMALL), "large": lambda: _kernel_cases(LARGE),
                  "trees": lambda: _kernel_cases(TREES), "bench": _bench_dry_run}, sys.argv[1:])
