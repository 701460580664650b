"""One training run on many processes, with PyTorch's own engine (torch.distributed, via
torchrun). Used only under torchrun (WORLD_SIZE > 1); DDP's and FSDP's modules are
imported where used.

    # 8 GPUs, one machine
    torchrun --standalone --nproc_per_node=8 train.py CONFIG
    # 2 machines
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST \
             --master_port=29500 train.py CONFIG

torchrun starts one process per device and tells each who it is in the environment:
RANK (0 .. WORLD_SIZE-1 over all machines), LOCAL_RANK (its device on its machine),
WORLD_SIZE, LOCAL_WORLD_SIZE (processes on each machine), GROUP_WORLD_SIZE and
GROUP_RANK (machines, and this one's rank), and MASTER_ADDR/MASTER_PORT (where rank 0
listens). The command that continues a run (relaunch) is rebuilt from them: torchrun's
own arguments never reach a process's argv.

When a process dies, its machine's torchrun ends the others there and names it. On the
other machines, the collective the processes are in fails: gloo's at once (the
connection closes), NCCL's when its watchdog sees the error, else at the process
group's timeout (torch's default: 30 min for gloo, 10 min for NCCL), which is also how
long a process waits for a peer that froze or was cut off; only the wait for the data's
preparation is longer (leader_first). Each machine then ends with one line from its
local rank 0 (lost_peer_line), and the checkpoints on disk are whole.

Data parallel (DDP, the default): every rank holds the whole model and optimizer,
computes the gradients of its own slice of the batch, and backward averages them over
the ranks (all-reduce), so every rank takes the same optimizer step. Sharded (FSDP,
train.fsdp = true): each rank holds 1/world of every parameter, gradient and optimizer
state; a block's parameters are all-gathered just before it runs and its gradients
reduce-scattered back to their owners. Same maths, a fraction of the memory.

Backends: nccl between GPUs, gloo between CPU processes (what the tests use).
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

from common import ROOT, UserError, first_line, typed
from loading import list_checkpoints

# how long processes wait for their leaders' data preparation
LEADERS_TIMEOUT = timedelta(days=1)


def launched() -> bool:
    """Whether torchrun started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def join(device: torch.device) -> tuple[torch.device, int, int, int]:
    """Join torchrun's process group: (this process's device, rank, local rank, world
    size)."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    rank, local_rank, world = (int(os.environ[k]) for k in names)
    cuda = device.type == "cuda"
    if cuda:
        # one GPU per process
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise UserError(f"distributed training runs on cuda (nccl) or cpu (gloo), "
                        f"not {device.type}")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                device_id=device if cuda else None)
        # a run that fails: while Python is still whole
        atexit.register(leave, finished=False)
    return device, rank, local_rank, world


def leader_first(fn, leader: bool):
    """fn() on the leading processes first, then on the rest, which find its work done;
    an error of a leader is raised on every process, so that none waits for ever. The
    rest wait in a gloo group of their own, for up to LEADERS_TIMEOUT: the run's own
    timeout (10 min under NCCL) would end them while a leader prepares tens of GB of
    text, which takes hours."""
    # made by every process before any leader starts: making it waits for all of them
    waiting = dist.new_group(backend="gloo", timeout=LEADERS_TIMEOUT)
    error = None
    if leader:
        try:
            result = fn()
        except Exception as e:
            error = e
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error, group=waiting)
    if errors := [e for e in gathered if e is not None]:
        raise errors[0]
    return result if leader else fn()


def wrap(model: torch.nn.Module, device: torch.device, fsdp: bool, seed: int):
    """DDP(model), or model sharded in place by FSDP2 (each block a unit of gathering and
    freeing); the weights are every rank's same ones, and from here each rank draws its
    own dropout masks."""
    # DDP and FSDP cost seconds to import (torch._dynamo with them): only a run of many
    # processes pays it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    if dist.get_rank():
        torch.manual_seed(seed + dist.get_rank())
    if not fsdp:
        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sync_gradients(module: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward averages the gradients over the ranks: only a step's
    last micro-step does, the others accumulate locally (a whole all-reduce or
    reduce-scatter saved each)."""
    # FSDP's
    if hasattr(module, "set_requires_gradient_sync"):
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
    """(model, optimizer) state dicts as one process holds them, so that a checkpoint
    loads anywhere. Under FSDP every rank must call it: the shards are gathered to rank
    0, on the CPU."""
    if not hasattr(model, "set_requires_gradient_sync"):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    # keyed by parameter name, empty on ranks other than 0 (in a list: torch's helpers take
    # a lone optimizer for a torch.optim one)
    optim_state = get_optimizer_state_dict(model, [optimizer], options=options)
    if not optim_state:
        return model_state, optim_state
    index = {}
    groups = [{**g, "params": [index.setdefault(n, len(index)) for n in g["params"]]}
              for g in optim_state["param_groups"]]
    state = {index[n]: s for n, s in optim_state["state"].items()}
    return model_state, {"state": state, "param_groups": groups}


def load_full_state(model: torch.nn.Module, optimizer, model_state: dict,
                    optim_state: dict) -> None:
    """The inverse of full_state, on every rank: each keeps its own shards under FSDP."""
    if not hasattr(model, "set_requires_gradient_sync"):
        model.load_state_dict(model_state)
        return optimizer.load_state_dict(optim_state)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**g, "params": [order[i] for i in g["params"]]}
              for g in optim_state["param_groups"]]
    state = {order[i]: s for i, s in optim_state["state"].items()}
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=full)
    by_name = {"state": state, "param_groups": groups}
    set_optimizer_state_dict(model, [optimizer], by_name, options=full)


def agreed_stop(signum: int, device: torch.device) -> int:
    """The signal that stops the run (0: none), the same on every rank at the same step:
    the largest number any rank was sent (a Ctrl-C on one machine stops them all)."""
    t = torch.tensor([float(signum)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def leave(finished: bool = True) -> None:
    """Destroy the process group while Python is still alive (gloo's threads can abort a
    process left to interpreter shutdown); after a clean run, free what still holds the
    group first (DDP and FSDP sit in reference cycles that only the garbage collector
    frees) and wait for every rank."""
    if dist.is_initialized():
        if finished:
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()


def relaunch(*args: str) -> str:
    """The command that starts this run's processes as torchrun started them, train.py
    given args: as many processes on each machine, and on several machines the same
    rendezvous (the command of this machine, and the note that each machine runs it with
    its own --node_rank)."""
    env = os.environ
    per_node = env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    script = [typed(ROOT / "train.py"), *args]
    if env.get("GROUP_WORLD_SIZE", "1") == "1":
        return shlex.join(["torchrun", "--standalone", f"--nproc_per_node={per_node}",
                           *script])
    words = [f"--nnodes={env['GROUP_WORLD_SIZE']}", f"--node_rank={env['GROUP_RANK']}",
             f"--nproc_per_node={per_node}", f"--master_addr={env['MASTER_ADDR']}",
             f"--master_port={env['MASTER_PORT']}"]
    command = shlex.join(["torchrun", *words, *script])
    return command + " (on each machine, with its own --node_rank)"


@contextmanager
def lost_peer_line(out_dir, again: str):
    """A collective that fails because another process of the run ended or stopped
    answering (gloo's transport errors, torch.distributed's own) ends this process with
    one line, said by local rank 0 alone (the machine's other processes end quietly, exit
    2 all the same): the checkpoint kept and `again`, the command that continues the run
    from it. Any other error goes on as it is."""
    try:
        yield
    except RuntimeError as e:
        if not (isinstance(e, dist.DistError) or "gloo/transport/" in str(e)):
            raise
        if int(os.environ.get("LOCAL_RANK", "0")):
            sys.exit(2)
        step = (list_checkpoints(out_dir) or [(None, None)])[-1][0]
        kept = f"no checkpoint in {out_dir}"
        if step is not None:
            kept = f"the checkpoint of step {step} is kept in {out_dir}: {again} continues it"
        # gloo says "[file:line] What happened. What to do."
        why = first_line(e).split("] ", 1)[-1].split(". ")[0]
        raise UserError(f"another process of this run ended or stopped answering "
                        f"({why}); {kept}") from None
