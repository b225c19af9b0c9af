"""A draft tree's `layout` and `descend` (tree_paths.py, beside their references there) in one Triton program each,
and `stage` in one launch.

Why: the references are ~25 (layout), ~70 (descend at depth 8) and 7 (stage) tiny torch ops, each a launch of its own
in the tree pass's graph, which is what a small model's tree cycle paid for (docs/benchmarks.md, "Draft trees"). One
program holds the tree's nodes in registers (T <= 64), so each op is a few dozen dependent steps of a single program;
stage's programs each copy a block of the kept feature rows, the first also the commit's inputs.

Exactly the references' results: integer work only. layout follows each node's parent `max_depth` times (a load of
the parents per step) instead of pointer doubling; a well-formed tree (parents before children, no node deeper than
max_depth) gives the same ancestors. descend takes at each depth the valid child of the node it stands on whose token
is the chosen one, the lowest index first, as the reference's cumulative sum does.
"""

from __future__ import annotations

import torch

from . import pdl, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the references
    triton = None

MAX_NODES = 64  # MAX_PASS_TOKENS: one program's registers hold every node


def available(x: torch.Tensor) -> bool:
    return triton_runs_on(x) and x.shape[0] <= MAX_NODES


def layout(parents, depth, conv_kernel: int, max_depth: int):
    t = parents.shape[0]
    ancestors = torch.empty(t, t, dtype=torch.bool, device=parents.device)
    window_rows = torch.empty(t, conv_kernel, dtype=torch.long, device=parents.device)
    _layout_kernel[(1,)](parents, depth, ancestors.view(torch.uint8), window_rows, T=t, TAPS=conv_kernel,
                         MAX_DEPTH=max(max_depth, conv_kernel - 1), NODES=max(16, triton.next_power_of_2(t)),
                         num_warps=4, **pdl.options(parents))
    return ancestors, window_rows


def descend(chosen, tokens, parents, depth, valid, max_depth: int):
    out = torch.empty(2 + 2 * (max_depth + 1), dtype=torch.long, device=chosen.device)
    t = chosen.shape[0]
    _descend_kernel[(1,)](chosen, tokens, parents, depth, valid.view(torch.uint8), out, T=t, MAX_DEPTH=max_depth,
                          NODES=max(16, triton.next_power_of_2(t)), num_warps=1, **pdl.options(chosen))
    return out


STAGE_BLOCK = 1024  # feature columns a stage program copies (of every kept row)


def stage(result, window_rows, features, start, path_out, history_out, start_out):
    rows, width = path_out.shape[0], features.shape[1]
    kept = torch.empty(rows, width, dtype=features.dtype, device=features.device)
    taps = window_rows.shape[1]
    _stage_kernel[(triton.cdiv(width, STAGE_BLOCK),)](
        result, window_rows, features, start, path_out, history_out, start_out, kept, width, features.stride(0),
        window_rows.stride(0), ROWS=rows, TAPS=taps, ROW_BLOCK=max(2, triton.next_power_of_2(rows)),
        TAP_BLOCK=max(2, triton.next_power_of_2(taps)), BLOCK=STAGE_BLOCK, num_warps=4, **pdl.options(result))
    return kept


if triton is not None:
    @triton.jit
    def _stage_kernel(result, window_rows, features, start, path_out, history_out, start_out, kept, F, stride_f,
                      stride_w, ROWS: tl.constexpr, TAPS: tl.constexpr, ROW_BLOCK: tl.constexpr,
                      TAP_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        rows = tl.arange(0, ROW_BLOCK)
        row_ok = rows < ROWS
        path = tl.load(result + 2 + rows, mask=row_ok, other=0)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = row_ok[:, None] & (cols < F)[None, :]
        tl.store(kept + rows[:, None] * F + cols[None, :],
                 tl.load(features + path[:, None] * stride_f + cols[None, :], mask=inside), mask=inside)
        if tl.program_id(0) == 0:
            tl.store(path_out + rows, path, mask=row_ok)
            last = tl.load(result + 2 + tl.load(result))
            taps = tl.arange(0, TAP_BLOCK)
            tap_ok = (taps >= 1) & (taps < TAPS)
            tl.store(history_out + taps - 1, tl.load(window_rows + last * stride_w + taps, mask=tap_ok), mask=tap_ok)
            tl.store(start_out, tl.load(start))

    @triton.jit
    def _layout_kernel(parents, depth, ancestors, window_rows, T: tl.constexpr, TAPS: tl.constexpr,
                       MAX_DEPTH: tl.constexpr, NODES: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        nodes = tl.arange(0, NODES)
        real = nodes < T
        node_depth = tl.load(depth + nodes, mask=real, other=0)
        on_path = nodes[:, None] == nodes[None, :]  # [node i, node j]: j lies on i's path
        # tap TAPS - 1 is the node itself; tap TAPS - 1 - s its ancestor s steps up, or conv history row TAPS - 1 +
        # (its depth - s) where the path is shorter than s
        tl.store(window_rows + nodes * TAPS + TAPS - 1, (TAPS - 1 + nodes).to(tl.int64), mask=real)
        up = nodes
        for s in tl.static_range(1, MAX_DEPTH + 1):
            up = tl.load(parents + up, mask=real, other=0).to(tl.int32)  # the root is its own parent
            on_path = on_path | (nodes[None, :] == up[:, None])
            if s < TAPS:
                wanted = node_depth - s
                row = TAPS - 1 + tl.where(wanted >= 0, up.to(tl.int64), wanted)
                tl.store(window_rows + nodes * TAPS + TAPS - 1 - s, row, mask=real)
        inside = real[:, None] & real[None, :]
        tl.store(ancestors + nodes[:, None] * T + nodes[None, :], on_path.to(tl.uint8), mask=inside)

    @triton.jit
    def _descend_kernel(chosen, tokens, parents, depth, valid, out, T: tl.constexpr, MAX_DEPTH: tl.constexpr,
                        NODES: tl.constexpr, PDL: tl.constexpr):
        pdl.begin(PDL)
        nodes = tl.arange(0, NODES)
        real = nodes < T
        token = tl.load(tokens + nodes, mask=real, other=0)
        parent = tl.load(parents + nodes, mask=real, other=-1)
        node_depth = tl.load(depth + nodes, mask=real, other=-1)
        ok = real & (tl.load(valid + nodes, mask=real, other=0) != 0)
        here = tl.load(chosen + nodes, mask=real, other=0)  # the token chosen at each node
        root_token = tl.load(tokens)
        at = tl.full([], 0, tl.int32)          # the node the walk stands on
        going = tl.full([], 1, tl.int1)        # still descending
        accepted = tl.full([], 0, tl.int32)
        tl.store(out + 2, 0)
        tl.store(out + 3 + MAX_DEPTH, root_token)
        for level in tl.static_range(1, MAX_DEPTH + 1):
            want = tl.sum(tl.where(nodes == at, here, 0), 0)
            step = ok & (node_depth == level) & (parent == at) & (token == want) & going
            child = tl.min(tl.where(step, nodes, NODES), 0)
            found = child < NODES
            going = going & found
            at = tl.where(found, child, at)
            accepted += found.to(tl.int32)
            tl.store(out + 2 + level, tl.where(found, child, 0).to(tl.int64))
            tl.store(out + 3 + MAX_DEPTH + level, tl.where(found, tl.sum(tl.where(nodes == child, token, 0), 0),
                                                           root_token))
        tl.store(out, accepted.to(tl.int64))
        tl.store(out + 1, tl.sum(tl.where(nodes == at, here, 0), 0))
