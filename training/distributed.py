"""One training run on many processes, with PyTorch's own engine (torch.distributed, via torchrun).

    torchrun --standalone --nproc_per_node=8 train.py CONFIG                  # 8 GPUs, one machine
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 train.py CONFIG

torchrun starts one process per device and tells each who it is in the environment: RANK (0 ..
WORLD_SIZE-1 over all machines), LOCAL_RANK (its device on its machine), WORLD_SIZE, and
MASTER_ADDR/MASTER_PORT (where rank 0 listens). ProcessGroup is training/runtime.py's World for
that case: the same methods, now with collectives behind them.

Data parallel (DDP, the default): every rank holds the whole model and optimizer, computes the
gradients of its own slice of the batch, and backward averages them over the ranks (all-reduce), so
every rank takes the same optimizer step. Sharded (FSDP, train.fsdp = true): each rank holds 1/world
of every parameter, gradient and optimizer state; a block's parameters are all-gathered just before
it runs and its gradients reduce-scattered back to their owners. Same maths, a fraction of the memory.

Backends: nccl between GPUs, gloo between CPU processes (what the tests use).
"""
import gc
import os
import socket
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from common import ConfigError, alive, first_line
from training.runtime import World


class ProcessGroup(World):
    """This process's place among WORLD_SIZE processes joined by torchrun."""

    @classmethod
    def join(cls, device: torch.device) -> "ProcessGroup":
        rank, local_rank, size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)   # one GPU per process
            torch.cuda.set_device(device)
        elif device.type != "cpu":
            raise ConfigError(f"distributed training runs on cuda (nccl) or cpu (gloo), not {device.type}")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    device_id=device if device.type == "cuda" else None)
        group = cls(device, rank, local_rank, size)
        # the stop vote runs on the CPU (gloo) beside the GPUs' collectives, so it never waits for them
        group.vote_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        group.pending_vote = None
        group.peers = group.gather((socket.gethostname(), os.getpid()))   # to name a rank that dies
        return group

    def peer_failure(self, error: BaseException) -> str | None:
        """When a collective failed because another process of the run ended, which one, in one line;
        None for any other error. A rank on this machine is named; one elsewhere cannot be looked at."""
        if not isinstance(error, RuntimeError):
            return None
        host = socket.gethostname()
        gone = [r for r, (h, pid) in enumerate(self.peers) if r != self.rank and h == host and not alive(pid)]
        if gone:
            return (f"rank {gone[0]} of this run (PID {self.peers[gone[0]][1]}) ended, so rank {self.rank} stops "
                    f"too; torchrun's report says why it ended")
        if any(s in str(error).lower() for s in ("connection reset", "connection closed", "broken pipe")):
            return f"another process of this run ended ({first_line(error, 80)}), so rank {self.rank} stops too"
        return None

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= self.size
        return tensor

    def gather(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def on_main(self, fn):
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

    def wrap(self, model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
        """DDP(model), or model sharded in place by FSDP2 (each block is one unit of gathering and
        freeing; the root holds the embeddings)."""
        self.kind = "FSDP" if fsdp else "DDP"
        if fsdp:
            mesh = init_device_mesh(self.device.type, (self.size,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            return fully_shard(model, mesh=mesh)
        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                   gradient_as_bucket_view=True)

    def no_sync(self, module: torch.nn.Module, last: bool):
        """Only the last micro-step of an optimizer step averages the gradients; the others accumulate
        locally, skipping a whole all-reduce (DDP) or reduce-scatter (FSDP) each."""
        if is_sharded(module):
            module.set_requires_gradient_sync(last)
            return nullcontext()
        return nullcontext() if last else module.no_sync()

    def full_state(self, model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
        """Under FSDP this gathers the shards: every rank must call it, and rank 0 gets the full tensors
        (on the CPU), keyed by parameter index, so that a checkpoint loads anywhere, FSDP or not."""
        if not is_sharded(model):
            return super().full_state(model, optimizer)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)   # keyed by parameter name
        if not optim_state:   # ranks other than 0
            return model_state, optim_state
        index = {}
        groups = [{**g, "params": [index.setdefault(name, len(index)) for name in g["params"]]}
                  for g in optim_state["param_groups"]]
        return model_state, {"state": {index[n]: s for n, s in optim_state["state"].items()}, "param_groups": groups}

    def load_full_state(self, model: torch.nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
        """The inverse of full_state, on every rank: each keeps its own shards under FSDP."""
        if not is_sharded(model):
            return super().load_full_state(model, optimizer, model_state, optim_state)
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        by_name = {"state": {order[i]: s for i, s in optim_state["state"].items()},
                   "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_state["param_groups"]]}
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, by_name, options=options)

    def agree_to_stop(self, requested: bool) -> bool:
        """Without waiting on the GPU: each step every rank starts an asynchronous all-reduce of "I was
        asked to stop" and reads the previous step's result, long finished by then. So all ranks stop
        one step after the first signal, at the same step."""
        decided = False
        if self.pending_vote is not None:
            work, flag = self.pending_vote
            work.wait()
            decided = bool(flag.item())
        flag = torch.tensor([float(requested)])
        self.pending_vote = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.vote_group, async_op=True), flag)
        return decided

    def leave(self, finished: bool) -> None:
        """After a clean run: complete the last vote, free what still holds the group (DDP/FSDP modules
        sit in reference cycles that only the garbage collector frees), wait for every rank, then
        destroy the group, so that gloo's worker threads end while Python is still alive (left to
        interpreter shutdown, a worker that touches a Python object can abort the process). After an
        error, leave at once: the others may never arrive."""
        if not dist.is_initialized():
            return
        if finished:
            if self.pending_vote is not None:
                self.pending_vote[0].wait()
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()


def is_sharded(model: torch.nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")   # what fully_shard adds
