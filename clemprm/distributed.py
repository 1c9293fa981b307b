"""Data parallelism over processes with torch.distributed: which process this is, and how work is split and gathered.

A rule given ``processes: N`` (a Snakemake resource: the SLURM profile, or ``--set-resources``) runs its script under
``torchrun --standalone --nproc_per_node N`` (:func:`clemprm.workflow.setup_job`); each process calls
:func:`init_from_environment` and the stages use the functions here. With one process (the default) every function
is the identity, and torch is never imported for it.

* Generation splits its items (instances, label prefixes) round-robin over the ranks and gathers the results back
  into the items' order on every rank (:func:`map_split`): every episode has its own seed, so the records equal a
  single process's. A stage that does not split runs the same work on every rank; the records are the same either way.
* Training runs the Trainer's own DDP (the effective batch is kept: :func:`accumulation_steps`); the RL trainer
  splits its groups' rollouts and its trained turns over the ranks and sums the gradients (:func:`sum_gradients`).
* Rank 0 alone writes files (:func:`is_main`: the record writer, the JSON writer and the adapter writer ask it).

The process group uses NCCL on CUDA (one GPU per process: ``LOCAL_RANK``) and gloo on the CPU, where the tests run
two processes on one machine to prove that the records and weights do not depend on the process count.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _group_ready() -> bool:
    """Whether this process is one of several in an initialized process group (torch imported only if so)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    if not _group_ready():
        return 0
    import torch.distributed as dist
    return dist.get_rank()


def world_size() -> int:
    if not _group_ready():
        return 1
    import torch.distributed as dist
    return dist.get_world_size()


def is_main() -> bool:
    """Whether this process writes the outputs (rank 0, or the only process)."""
    return rank() == 0


def init_from_environment() -> int:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...) when there are
    several processes: NCCL on CUDA, with this process's GPU (``LOCAL_RANK``) as its device, gloo on the CPU. Returns
    the world size (1: nothing to join)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size()


def barrier() -> None:
    if _group_ready():
        import torch.distributed as dist
        dist.barrier()


def all_gather(value: T) -> list[T]:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
    if not _group_ready():
        return [value]
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def from_main(value: T) -> T:
    """Rank 0's ``value`` on every rank (e.g. a folder rank 0 made, or what it read from a checkpoint)."""
    return all_gather(value)[0]


def map_split(items: list[T], work: Callable[[list[T]], list[R]]) -> list[R]:
    """``work`` on this rank's share of ``items`` (items ``rank, rank + W, ...``), returning one result per item of
    the share; every item's result in the order of ``items``, on every rank. An exception on a rank fails that rank
    (torchrun then stops the others and fails the job)."""
    size = world_size()
    if size == 1:
        return work(items)
    items_here = share(items)
    mine = work(items_here)
    if len(mine) != len(items_here):
        raise ValueError(f"map_split: work returned {len(mine)} results for {len(items_here)} items")
    parts = all_gather(mine)
    return [parts[index % size][index // size] for index in range(len(items))]


def share(items: list[T]) -> list[T]:
    """This rank's round-robin share of ``items`` (all of them with one process)."""
    return items[rank()::world_size()]


def sum_gradients(params: list) -> None:
    """Every parameter's ``.grad`` summed over the ranks, in place, on every rank (one all-reduce of one flat
    buffer). A parameter without a gradient on some rank counts as zero there; with one process nothing happens."""
    if not _group_ready():
        return
    import torch
    import torch.distributed as dist

    grads = [param.grad if param.grad is not None else torch.zeros_like(param) for param in params]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    offset = 0
    for param, grad in zip(params, grads):
        param.grad = flat[offset:offset + grad.numel()].view_as(param).clone()
        offset += grad.numel()


def accumulation_steps(grad_accum: int, key: str) -> int:
    """The gradient accumulation of each process that keeps the configured effective batch (``batch_size x
    grad_accum``) over ``world_size()`` processes: ``grad_accum / W``. ``key``: the config key, for the error when
    ``grad_accum`` is not a multiple of the process count."""
    size = world_size()
    if grad_accum % size:
        raise ValueError(f"{key} {grad_accum} is not a multiple of the job's {size} processes: the effective batch "
                         f"(batch_size x grad_accum) is kept by accumulating grad_accum / processes steps in each "
                         f"process; set {key} to a multiple of {size}")
    return grad_accum // size
