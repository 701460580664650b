"""Distributed training on CPU (gloo): 2 processes launched by torchrun, as a user would, give the
run that 1 process gives with the same global batch; only rank 0 writes; checkpoints cross world
sizes and FSDP, and a resume at another global batch says what keeps it; the processes wait for
their data's leaders longer than the run's own collective timeout.

One tiny run shape, six ways, all ending at step 6 with the same weights:
  base   1 process, batch 8                      (in this process)
  accum  1 process, batch 4 x 2 accumulation     (in this process)
  ddp    2 processes (DDP), batch 4 each
  fsdp   2 processes (FSDP), batch 2 x 2 accumulation each, resumed from base's step-2 checkpoint
  r_ddp  1 process, batch 4 x 2, resumed from ddp's step-4 checkpoint
  r_fsdp 1 process, batch 8, resumed from fsdp's step-4 checkpoint
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from loading import load_model, read_checkpoint
from tests.conftest import ROOT, TEXT, tiny_overrides
from training.config import build_config
from training.trainer import resized, train

pytestmark = pytest.mark.skipif(os.name == "nt" or not torch.distributed.is_available(),
                                reason="torchrun and gloo as this project uses them: Linux and macOS (not tried on Windows)")
STEPS = 6


def args(tmp, text_file, out, **extra):
    values = {"train.max_steps": STEPS, "train.warmup_steps": 2, "train.eval_interval": 2, "train.eval_iters": 2,
              "train.batch_size": 8, "train.device": "cpu", "out_dir": tmp / out}
    values.update(extra)
    return tiny_overrides(tmp, text_file, **values)


def torchrun(*argv):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *argv]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"},
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:   # where it stopped
        raise AssertionError(f"torchrun timed out\n{(e.stdout or b'')[-3000:]}\n{(e.stderr or b'')[-3000:]}") from None
    assert r.returncode == 0, f"torchrun exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr}"
    return r


def copy_checkpoint(src_dir, step, dst_dir):
    dst_dir.mkdir(parents=True)
    shutil.copy(src_dir / f"ckpt_{step:07d}.pt", dst_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    text_file = tmp / "tiny.txt"
    text_file.write_text(TEXT)
    def run(out, resume=False, **extra):
        train(build_config(None, args(tmp, text_file, out, **extra)), resume=resume, quiet=True)

    run("base", **{"train.keep_checkpoints": 3})
    copy_checkpoint(tmp / "base", 2, tmp / "fsdp")
    run("accum", **{"train.batch_size": 4, "train.grad_accum": 2})
    ddp = torchrun(*args(tmp, text_file, "ddp", **{"train.batch_size": 4}))
    fsdp = torchrun(*args(tmp, text_file, "fsdp", **{"train.batch_size": 2, "train.grad_accum": 2,
                                                     "train.fsdp": "true"}), "--resume")
    copy_checkpoint(tmp / "ddp", 4, tmp / "r_ddp")
    run("r_ddp", resume=True, **{"train.batch_size": 4, "train.grad_accum": 2})
    copy_checkpoint(tmp / "fsdp", 4, tmp / "r_fsdp")
    run("r_fsdp", resume=True)
    return tmp, {"ddp": ddp, "fsdp": fsdp}


def final(tmp, name):
    return read_checkpoint(tmp / name / f"ckpt_{STEPS:07d}.pt")


@pytest.mark.parametrize("name", ["accum", "ddp", "fsdp", "r_ddp", "r_fsdp"])
def test_same_global_batch_same_weights(runs, name):
    tmp, _ = runs
    want, got = final(tmp, "base"), final(tmp, name)
    assert got["step"] == STEPS and got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key], value, atol=1e-5, rtol=0, msg=f"{name}: {key}")
    for i, state in want["optimizer"]["state"].items():   # FSDP's optimizer state is saved as 1 process's
        torch.testing.assert_close(got["optimizer"]["state"][i]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-7, rtol=1e-3)


def test_evaluation_is_averaged_over_the_ranks(runs):
    tmp, _ = runs
    def val_losses(name):
        return [r["val_loss"] for r in map(json.loads, open(tmp / name / "metrics.jsonl")) if r["kind"] == "eval"]
    assert val_losses("ddp") == pytest.approx(val_losses("base"), abs=1e-5)   # not rank 0's half alone


def test_only_rank_0_writes(runs):
    tmp, out = runs
    records = [json.loads(l) for l in open(tmp / "ddp" / "metrics.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert out["ddp"].stdout.count("step      1 |") == 1 and out["ddp"].stdout.count("# done") == 1
    assert "x 2 processes (DDP)" in out["ddp"].stdout and "x 2 processes (FSDP)" in out["fsdp"].stdout
    assert sorted(os.listdir(tmp / "ddp")) == ["best.pt", "ckpt_0000004.pt", "ckpt_0000006.pt",
                                                "config.toml", "metrics.jsonl"]


def test_a_resume_at_another_global_batch_says_what_keeps_it(runs, capsys):
    """ddp's checkpoint (2 processes x batch 4) resumed on one process: at batch 4 the global batch
    halves, and the banner says so with the setting that keeps it; at batch 4 x 2 it says nothing."""
    tmp, _ = runs
    for name, accum in (("half", 1), ("same", 2)):
        copy_checkpoint(tmp / "ddp", 4, tmp / name)
        capsys.readouterr()
        train(build_config(None, args(tmp, tmp / "tiny.txt", name, **{"train.batch_size": 4,
                                                                         "train.grad_accum": accum})), resume=True)
        banner = [line for line in capsys.readouterr().out.splitlines() if "tokens/step:" in line]
        assert banner == (["# resuming with tokens/step: 256 -> 128 (2 processes -> 1): --train.grad_accum=2 "
                           "keeps it"] if name == "half" else []), banner


@pytest.mark.parametrize("batch, accum, line", [
    (2, 1, "256 -> 64 (2 processes -> 1): --train.grad_accum=4 keeps it"),
    (3, 2, "256 -> 192 (2 processes -> 1): --train.batch_size=4 keeps it"),
    (3, 3, "256 -> 288 (2 processes -> 1): no whole --train.grad_accum or --train.batch_size keeps it")])
def test_the_setting_named_to_keep_the_global_batch(batch, accum, line):
    """grad_accum first (the memory a step takes stays), else batch_size, where a whole number does."""
    t = build_config(None, [f"--train.batch_size={batch}", f"--train.grad_accum={accum}"]).train
    assert resized((8, 2), t, 1, 32) == f"# resuming with tokens/step: {line}"


def test_fsdp_checkpoint_loads_in_one_plain_process(runs):
    tmp, _ = runs
    path = tmp / "fsdp" / f"ckpt_{STEPS:07d}.pt"
    load_model(path)   # as sample.py reads it: full tensors under their plain names, each shape checked
    assert len(read_checkpoint(path)["rng_ranks"]) == 2


def prepare_slowly(rank: int, store: str) -> None:
    """One of 2 processes whose group times out after 1 s: the leader's work takes 2."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from training.distributed import leader_first
    # both processes here, however long a busy machine took to start them, before the 1 s counts
    open(f"{store}.{rank}", "w").close()
    while not os.path.exists(f"{store}.{1 - rank}"):
        time.sleep(0.01)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=1))
    try:
        assert leader_first(lambda: time.sleep(2 if rank == 0 else 0) or rank, rank == 0) == rank
    finally:
        dist.destroy_process_group()


def test_the_others_wait_for_a_leader_longer_than_the_run_timeout(tmp_path):
    """Data preparation can take hours; the process group's timeout (10 min under NCCL) must not end
    the processes that wait for it."""
    torch.multiprocessing.spawn(prepare_slowly, args=(str(tmp_path / "store"),), nprocs=2)


def test_gradients_are_synced_only_on_the_last_micro_step(tmp_path):
    """DDP's all-reduce runs once per optimizer step, not once per micro-step (a 1-process gloo group
    is enough to count the reducer's calls)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from training.trainer import sync_gradients
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(4, 4))
        calls = []
        def count(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        model.register_comm_hook(None, count)
        for micro in range(3):
            sync_gradients(model, micro == 2)
            model(torch.randn(2, 4)).sum().backward()
            assert len(calls) == (1 if micro == 2 else 0)
    finally:
        dist.destroy_process_group()
