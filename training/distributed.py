"""One training run on many processes, with PyTorch's own engine (torch.distributed, via torchrun).

    torchrun --standalone --nproc_per_node=8 train.py CONFIG                  # 8 GPUs, one machine
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 train.py CONFIG

torchrun starts one process per device and tells each who it is in the environment: RANK (0 ..
WORLD_SIZE-1 over all machines), LOCAL_RANK (its device on its machine), WORLD_SIZE, and
MASTER_ADDR/MASTER_PORT (where rank 0 listens). Without these there is one process, no process
group, and every helper here does nothing: single-device training is the same code.

Data parallel (DDP, the default): every rank holds the whole model and optimizer, computes the
gradients of its own slice of the batch, and backward averages them over the ranks (all-reduce), so
every rank takes the same optimizer step. Sharded (FSDP, train.fsdp = true): each rank holds 1/world
of every parameter, gradient and optimizer state; a block's parameters are all-gathered just before
it runs and its gradients reduce-scattered back to their owners. Same maths, a fraction of the memory.

Backends: nccl between GPUs, gloo between CPU processes (what the tests use).
"""
import gc
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Dist:
    """Who this process is in the run. world == 1: a single process, and all methods are no-ops."""
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints, writes metrics and saves checkpoints."""
        return self.rank == 0

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of tensor over the ranks (in place; every rank gets it)."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.world
        return tensor

    def any(self, flag: bool) -> bool:
        """True on every rank if flag is true on any (a blocking vote: for rare decisions)."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank (any picklable object)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def on_main(self, fn):
        """fn() run on rank 0 only; every rank returns its result, or raises the error it raised."""
        if self.world == 1:
            return fn()
        box = [None]
        if self.is_main:
            try:
                box = [("ok", fn())]
            except Exception as e:   # re-raised on every rank, so none waits forever for the others
                box = [("error", e)]
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    def local_main_first(self, fn):
        """fn() on each machine's local rank 0 first (e.g. preparing data into a cache), then on the
        other ranks (which then find it done); an error on any leader is raised on every rank."""
        if self.world == 1:
            return fn()
        leader = self.local_rank == 0
        result, error = None, None
        if leader:
            try:
                result = fn()
            except Exception as e:
                error = e
        errors = [e for e in self.gather(error) if e is not None]
        if errors:
            raise errors[0]
        return result if leader else fn()


class StopVote:
    """Ranks agree to stop at the same step without waiting on the GPU: each step every rank starts
    an asynchronous all-reduce (on the CPU, through a gloo group) of "I was asked to stop", and reads
    the previous step's result, long finished by then. So all ranks stop one step after the first
    signal, at the same step. A single process decides at once."""

    def __init__(self, ctx: "Dist"):
        self.ctx, self.pending, self.group = ctx, None, None
        if ctx.world > 1:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def __call__(self, requested: bool) -> bool:
        if self.ctx.world == 1:
            return requested
        decided = False
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            decided = bool(flag.item())
        flag = torch.tensor([float(requested)])
        self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return decided

    def finish(self) -> None:
        """Complete the last vote, so that no collective is left in flight."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None


def setup(device: torch.device) -> Dist:
    """Join the process group that torchrun describes in the environment; Dist() without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)   # one GPU per process
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        from training.config import ConfigError
        raise ConfigError(f"distributed training runs on cuda (nccl) or cpu (gloo), not {device.type}")
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Dist(rank, local_rank, world, device)


def teardown(wait_for_others: bool) -> None:
    """Leave the process group (if there is one) before the process ends.

    After a clean run: free what still holds the group (DDP/FSDP modules sit in reference cycles
    that only the garbage collector frees), wait for every rank, then destroy it, so that gloo's
    worker threads end while Python is still alive. Left to interpreter shutdown, a worker that
    touches a Python object can abort the process ("terminate called without an active exception").
    After an error, leave at once: the others may never arrive."""
    if dist.is_available() and dist.is_initialized():
        if wait_for_others:
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, ctx: Dist, fsdp: bool) -> torch.nn.Module:
    """The module to train with: model itself (one process), DDP(model), or model sharded in place
    by FSDP2 (each block is one unit of gathering and freeing; the root holds the embeddings)."""
    if ctx.world == 1:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def is_sharded(model: torch.nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")   # what fully_shard adds


def sync_gradients(model: torch.nn.Module, sync: bool):
    """Context for one micro-step (forward and backward). Only the last micro-step of an optimizer
    step needs the gradients averaged over the ranks; the others accumulate locally, skipping a
    whole all-reduce (DDP) or reduce-scatter (FSDP) each."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return nullcontext()


def full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts as one process would have them: full tensors, optimizer state
    keyed by parameter index. Under FSDP this gathers the shards: every rank must call it, and
    rank 0 gets the result (on the CPU), so a checkpoint loads anywhere, FSDP or not."""
    if not is_sharded(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)   # keyed by parameter name
    if not optim_state:   # ranks other than 0
        return model_state, optim_state
    index = {}
    groups = [{**g, "params": [index.setdefault(name, len(index)) for name in g["params"]]}
              for g in optim_state["param_groups"]]
    return model_state, {"state": {index[n]: s for n, s in optim_state["state"].items()}, "param_groups": groups}


def load_full_state(model: torch.nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
    """The inverse of full_state, on every rank: each keeps its own shards under FSDP."""
    if not is_sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {"state": {order[i]: s for i, s in optim_state["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_state["param_groups"]]}
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
