"""Bounded drafter context: per-layer K/V of committed target positions in fixed ring buffers.

A drafter query at absolute position t only sees context positions p with t - p < sliding_window,
and the earliest query of a block sits right after the last committed position. So the last
`sliding_window` committed positions are all any proposal can use; older rows are overwritten in place.
K is stored with rotary embedding already applied at its absolute position, so rows never move.
Each layer's buffer is [slots, kv_heads, head_dim] like the target's KV cache, with `block` scratch slots after
the ring: a proposal writes its own block's K/V there, so that its attention reads one buffer per layer.
"""

from __future__ import annotations

import torch

# Position recorded for a never-written slot: so far back that no window reaches it.
EMPTY_SLOT = -(2**62)


class DrafterContext:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        block: int = 0,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        self.capacity = capacity
        shape = (num_layers, capacity + block, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.full((capacity,), EMPTY_SLOT, device=device, dtype=torch.long)
        self.block_slots = torch.arange(capacity, capacity + block, device=device)
        self.length = 0  # committed positions so far; the next append starts here
        self.allocate_snapshots(0)

    def allocate_snapshots(self, count: int) -> int:
        """Room for `count` copies of the ring (keys, values, positions; not the block scratch slots): returns their
        bytes. A rewind needs them: rows older than the rewound position were overwritten by later ones."""
        self.saved_keys = self.keys.new_zeros(count, *self.keys[:, :self.capacity].shape)
        self.saved_values = torch.zeros_like(self.saved_keys)
        self.saved_positions = self.positions.new_zeros(count, self.capacity)
        self.saved_lengths = [0] * count
        return self.saved_keys.nbytes + self.saved_values.nbytes + self.saved_positions.nbytes

    def save(self, slot: int) -> None:
        self.saved_keys[slot].copy_(self.keys[:, :self.capacity])
        self.saved_values[slot].copy_(self.values[:, :self.capacity])
        self.saved_positions[slot].copy_(self.positions)
        self.saved_lengths[slot] = self.length

    def restore(self, slot: int) -> None:
        """Back to the committed rows saved in `slot` (the block scratch slots are rewritten by every proposal)."""
        self.keys[:, :self.capacity].copy_(self.saved_keys[slot])
        self.values[:, :self.capacity].copy_(self.saved_values[slot])
        self.positions.copy_(self.saved_positions[slot])
        self.length = self.saved_lengths[slot]

    def reset(self) -> None:
        """Forget everything for a new request, keeping the same buffers."""
        self.keys.zero_()
        self.values.zero_()
        self.positions.fill_(EMPTY_SLOT)
        self.length = 0

    def write(self, keys: torch.Tensor, values: torch.Tensor, start_position: int) -> None:
        """Store rows for positions start_position .. start_position + n - 1.

        keys, values: [num_layers, n, num_kv_heads, head_dim] with n <= capacity. Positions between the
        current length and start_position may be skipped only when they would be overwritten anyway.
        """
        rows = keys.shape[1]
        if rows > self.capacity:
            raise ValueError(f"{rows} context rows do not fit {self.capacity} slots; keep only the last ones")
        if start_position < self.length:
            raise ValueError(f"context position {start_position} was already written (length {self.length})")
        if rows == 0:
            return
        positions = torch.arange(start_position, start_position + rows, device=self.positions.device)
        self.write_rows(keys, values, positions)
        self.commit(start_position, rows)

    def commit(self, start_position: int, rows: int) -> None:
        """Positions start_position .. + rows - 1 are now written (the one place the committed length moves)."""
        if start_position < self.length:
            raise ValueError(f"context position {start_position} was already written (length {self.length})")
        self.length = start_position + rows

    def write_rows(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """The buffer update alone (no checks, length unchanged): positions is a device tensor."""
        slots = self.record(positions)
        self.keys.index_copy_(1, slots, keys.to(self.keys.dtype))
        self.values.index_copy_(1, slots, values.to(self.values.dtype))

    def record(self, positions: torch.Tensor) -> torch.Tensor:
        """Mark the ring slots of `positions` (a device tensor) as holding them; returns those slots, where the
        caller writes their K/V (one index per row also handles wraparound)."""
        slots = positions % self.capacity
        self.positions.index_copy_(0, slots, positions)
        return slots
