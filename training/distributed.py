"""One training run on many processes, with PyTorch's own engine (torch.distributed, via torchrun).
Imported only under torchrun (WORLD_SIZE > 1).

    torchrun --standalone --nproc_per_node=8 train.py CONFIG                  # 8 GPUs, one machine
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 \
             train.py CONFIG                                                                # 2 machines

torchrun starts one process per device and tells each who it is in the environment: RANK (0 ..
WORLD_SIZE-1 over all machines), LOCAL_RANK (its device on its machine), WORLD_SIZE, and
MASTER_ADDR/MASTER_PORT (where rank 0 listens). If a process dies, torchrun ends the others and
names it in its report.

Data parallel (DDP, the default): every rank holds the whole model and optimizer, computes the
gradients of its own slice of the batch, and backward averages them over the ranks (all-reduce), so
every rank takes the same optimizer step. Sharded (FSDP, train.fsdp = true): each rank holds 1/world
of every parameter, gradient and optimizer state; a block's parameters are all-gathered just before
it runs and its gradients reduce-scattered back to their owners. Same maths, a fraction of the memory.

Backends: nccl between GPUs, gloo between CPU processes (what the tests use).
"""
import atexit
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from common import UserError


def join(device: torch.device) -> tuple[torch.device, int, int, int]:
    """Join torchrun's process group: (this process's device, rank, local rank, world size)."""
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)   # one GPU per process
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise UserError(f"distributed training runs on cuda (nccl) or cpu (gloo), not {device.type}")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
        atexit.register(leave, finished=False)   # a run that fails: while Python is still whole
    return device, rank, local_rank, world


def leader_first(fn, leader: bool):
    """fn() on the leading processes first, then on the rest, which find its work done; an error of a
    leader is raised on every process, so that none waits for ever."""
    error = None
    if leader:
        try:
            result = fn()
        except Exception as e:
            error = e
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    if errors := [e for e in gathered if e is not None]:
        raise errors[0]
    return result if leader else fn()


def wrap(model: torch.nn.Module, device: torch.device, fsdp: bool, seed: int) -> torch.nn.Module:
    """DDP(model), or model sharded in place by FSDP2 (each block a unit of gathering and freeing); the
    weights are every rank's same ones, and from here each rank draws its own dropout masks."""
    if dist.get_rank():
        torch.manual_seed(seed + dist.get_rank())
    if not fsdp:
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   gradient_as_bucket_view=True)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sync_gradients(module: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward averages the gradients over the ranks: only a step's last micro-step
    does, the others accumulate locally (a whole all-reduce or reduce-scatter saved each)."""
    if hasattr(module, "set_requires_gradient_sync"):   # FSDP
        module.set_requires_gradient_sync(sync)
    else:
        module.require_backward_grad_sync = sync


def mean(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of tensor over the ranks, in place on every rank."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.div_(dist.get_world_size())


def gather(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts as one process holds them, so that a checkpoint loads anywhere.
    Under FSDP every rank must call it: the shards are gathered to rank 0, on the CPU."""
    if not hasattr(model, "set_requires_gradient_sync"):
        return model.state_dict(), optimizer.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    # keyed by parameter name (a list: torch's helpers take a lone optimizer for a torch.optim one)
    optim_state = get_optimizer_state_dict(model, [optimizer], options=options)
    if not optim_state:   # ranks other than 0
        return model_state, optim_state
    index = {}
    groups = [{**g, "params": [index.setdefault(name, len(index)) for name in g["params"]]}
              for g in optim_state["param_groups"]]
    return model_state, {"state": {index[n]: s for n, s in optim_state["state"].items()},
                         "param_groups": groups}


def load_full_state(model: torch.nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
    """The inverse of full_state, on every rank: each keeps its own shards under FSDP."""
    if not hasattr(model, "set_requires_gradient_sync"):
        model.load_state_dict(model_state)
        return optimizer.load_state_dict(optim_state)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {"state": {order[i]: s for i, s in optim_state["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]}
                                for g in optim_state["param_groups"]]}
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=full)
    set_optimizer_state_dict(model, [optimizer], by_name, options=full)


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether any rank says flag (a stop asked for): every rank gets the same answer, at the same step."""
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def leave(finished: bool = True) -> None:
    """Destroy the process group while Python is still alive (gloo's threads can abort a process left to
    interpreter shutdown); after a clean run, free what still holds the group first (DDP and FSDP sit
    in reference cycles that only the garbage collector frees) and wait for every rank."""
    if dist.is_initialized():
        if finished:
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()
