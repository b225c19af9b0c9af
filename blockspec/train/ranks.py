"""Training in several processes, one a GPU, started by torchrun (`torchrun --nproc-per-node N -m blockspec
train-drafter ...`): torch.distributed, NCCL on CUDA and gloo on the CPU. A plain process is a world of one, where
nothing is exchanged.

Every rank draws the step's sequences (and anchors) from the same random state, so the global batch is the same
whatever the world size, and runs its share of them; the trained module runs under DistributedDataParallel, which
averages the gradients over the ranks. The frozen target is whole on every rank, or its decoder layers are sharded
across the ranks with FSDP2 (`shard_layers`) when it and the training state do not fit one GPU together.

A checkpoint holds the trained module whole and the random state every rank shares, so a run resumes on any number
of processes that shares its step evenly."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def launched() -> tuple[int, int, int]:
    """(rank, world size, local rank), as torchrun sets them; (0, 1, 0) in a process it did not start."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


class Ranks:
    """This process's place among the run's processes, and what they do together."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes, logs and evaluates."""
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's share of the items every rank drew alike (as many as a multiple of the world size)."""
        count = len(items) // self.world
        return items[self.rank * count:(self.rank + 1) * count]

    def total(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor summed over the ranks (detached: a count, a figure)."""
        if self.world == 1:
            return tensor.detach()
        summed = tensor.detach().clone()
        dist.all_reduce(summed)
        return summed

    def replicate(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The module whose forward the step runs: under DistributedDataParallel in several processes."""
        if self.world == 1:
            return module
        # the gradients live in DistributedDataParallel's buckets (not a second copy of them: 7.7 GB for a 1.9B drafter)
        return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)

    def shard_layers(self, model: torch.nn.Module, device: torch.device) -> None:
        """The frozen target's decoder layers sharded across the ranks with FSDP2: each rank keeps 1/world of every
        layer's weights and gathers a layer's whole weights just before it runs (the next layer's gather already on
        its way), then frees them. The embedding, final norm and head stay whole on every rank: the drafter reads
        them outside the target's forward. The model may be on the CPU: each layer moves to `device` as it is
        sharded, so the whole target never sits on one GPU. Every rank must then run the target equally often
        (the gathers are collective): the ranks' shares of a step are equal."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (self.world,))
        layers = list(model.layers)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        for earlier, later in zip(layers, layers[1:]):
            earlier.set_modules_to_forward_prefetch([later])
        for name, child in model.named_children():
            if name != "layers":
                child.to(device)
        # the root manages none of its own weights: it only orders the layers' gathers as one forward's
        fully_shard(model, mesh=mesh, ignored_params={p for n, p in model.named_parameters()
                                                      if not n.startswith("layers.")})

    def from_main(self, value):
        """Rank 0's value, on every rank (what only rank 0 computed: an evaluation)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def rank_device(device: torch.device) -> torch.device:
    """A CUDA run's GPU: the one of this process's local rank."""
    return torch.device("cuda", launched()[2]) if device.type == "cuda" else device


@contextmanager
def process_group(device: torch.device):
    """The run's Ranks: under torchrun with several processes, a process group (NCCL on CUDA, gloo on the CPU) for
    the time of the run."""
    rank, world, _ = launched()
    if world == 1:
        yield Ranks()
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        yield Ranks(rank, world)
        dist.barrier()  # every rank done with the group (rank 0 writes last) before any tears it down
    finally:
        dist.destroy_process_group()
