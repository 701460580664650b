"""One training run on many processes under torchrun (docs/distributed.md); only such a run
loads this module.

DDP (the default): every process holds the whole model; backward averages the gradients.
FSDP (train.fsdp): each holds 1/world of every parameter, gradient and optimizer state, and
gathers a block's parameters just before it runs: the same maths in a fraction of the memory.
"""
import atexit
import gc
import os
import shlex
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from common import ROOT, UserError, first_line, typed
from loading import list_checkpoints
from training.optim import rekeyed

# how long processes wait for their leaders' data preparation (tens of GB)
LEADERS_TIMEOUT = timedelta(days=1)


def join(device: torch.device) -> tuple[torch.device, int, int, int]:
    """Join torchrun's process group: (this process's device, rank, local rank, world)."""
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    cuda = device.type == "cuda"
    if cuda:
        # one GPU per process
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise UserError(f"distributed training runs on cuda (nccl) or cpu (gloo), "
                        f"not {device.type}")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        # a run that fails leaves while Python is still whole
        atexit.register(leave, finished=False)
    return device, rank, local_rank, world


def leader_first(fn, leader: bool):
    """fn() on the leaders, then on the rest, which find its work done; a leader's error is
    raised everywhere."""
    # made by every process before any leader starts: making it waits for all of them
    waiting = dist.new_group(backend="gloo", timeout=LEADERS_TIMEOUT)
    error = None
    if leader:
        try:
            result = fn()
        except Exception as e:
            error = e
    if errors := [e for e in gather(error, waiting) if e is not None]:
        raise errors[0]
    return result if leader else fn()


def wrap(model: torch.nn.Module, device: torch.device, fsdp: bool, seed: int):
    """DDP(model), or model sharded in place by FSDP2 (a block at a time); from here each
    rank draws its own dropout masks."""
    if dist.get_rank():
        torch.manual_seed(seed + dist.get_rank())
    if not fsdp:
        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP holds model (DDP has no set_requires_gradient_sync)."""
    return hasattr(model, "set_requires_gradient_sync")


def full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts as one process holds them, on every rank: a checkpoint
    loads anywhere. Under FSDP rank 0's CPU gets the shards."""
    if not sharded(model):
        return model.state_dict(), optimizer.state_dict()
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = dcp.get_model_state_dict(model, options=options)
    # keyed by name, empty but on rank 0 (a list: a lone optimizer is taken for torch.optim's)
    optim_state = dcp.get_optimizer_state_dict(model, [optimizer], options=options)
    if not optim_state:
        return model_state, optim_state
    index = {}
    return model_state, rekeyed(optim_state, lambda n: index.setdefault(n, len(index)))


def load_full_state(model: torch.nn.Module, optimizer, model_state: dict,
                    optim_state: dict) -> None:
    """The inverse of full_state, on every rank: each keeps its own shards under FSDP."""
    if not sharded(model):
        model.load_state_dict(model_state)
        return optimizer.load_state_dict(optim_state)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    full = dcp.StateDictOptions(full_state_dict=True)
    dcp.set_model_state_dict(model, model_state, options=full)
    by_name = rekeyed(optim_state, order.__getitem__)
    dcp.set_optimizer_state_dict(model, [optimizer], by_name, options=full)


def gather(obj, group=None) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def mean(tensor: torch.Tensor) -> torch.Tensor:
    """In place, on every rank."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.div_(dist.get_world_size())


def agreed_stop(signum: int, device: torch.device) -> int:
    """The largest signal any rank was sent (0: none): a Ctrl-C on one machine stops all."""
    t = torch.tensor([float(signum)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def leave(finished: bool = True) -> None:
    """Destroy the process group while Python is whole (gloo's threads can abort a process
    at shutdown); after a clean run, first free DDP's reference cycles and wait for all."""
    if dist.is_initialized():
        if finished:
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()


def relaunch(*args: str) -> str:
    """The torchrun command that starts this run's processes again."""
    env = os.environ
    per_node = f"--nproc_per_node={env.get('LOCAL_WORLD_SIZE', env['WORLD_SIZE'])}"
    script = [typed(ROOT / "train.py"), *args]
    if env.get("GROUP_WORLD_SIZE", "1") == "1":
        return shlex.join(["torchrun", "--standalone", per_node, *script])
    words = [f"--nnodes={env['GROUP_WORLD_SIZE']}", f"--node_rank={env['GROUP_RANK']}",
             per_node, f"--master_addr={env['MASTER_ADDR']}",
             f"--master_port={env['MASTER_PORT']}"]
    note = " (on each machine, with its own --node_rank)"
    return shlex.join(["torchrun", *words, *script]) + note


@contextmanager
def lost_peer_line(out_dir, again: str):
    """A lost process (torchrun ends its machine's others; elsewhere a collective fails):
    exit 2, and from each machine's local rank 0 one line: the checkpoint kept and `again`,
    the command that continues it."""
    try:
        yield
    except RuntimeError as e:
        if not (isinstance(e, dist.DistError) or "gloo/transport/" in str(e)):
            raise
        if int(os.environ.get("LOCAL_RANK", "0")):
            sys.exit(2)
        kept = f"no checkpoint in {out_dir}"
        if saved := list_checkpoints(out_dir):
            kept = (f"the checkpoint of step {saved[-1][0]} is kept in {out_dir}: "
                    f"{again} continues it")
        # gloo says "[file:line] What happened. What to do."
        why = first_line(e).split("] ", 1)[-1].split(". ")[0]
        raise UserError(f"another process of this run ended or stopped answering "
                        f"({why}); {kept}") from None
