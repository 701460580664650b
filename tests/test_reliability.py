"""Checkpoints that cannot be lost or abused, failures in the middle of a run, numerical faults that
stop or skip cleanly, and resuming after any of them (the bad-input table: tests/test_bad_input.py)."""
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample as sample_cli
import train as train_cli
from common import UserError
from model.gpt import GPT
from tests.conftest import TEXT, Evil, mkdir, poison, prepare_text, run_limited, run_tool, settled, tiny_overrides, tree, write
from training.checkpoint import FORMAT, VERSION, list_checkpoints, load_checkpoint
from training.trainer import NonFinite, train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_holds_everything_a_resume_needs(trained):
    ckpt = load_checkpoint(trained / "ckpt_0000004.pt")
    assert ckpt["format"] == FORMAT and ckpt["version"] == VERSION and ckpt["step"] == 4 and ckpt["tokens"] == 4 * 8 * 32
    assert ckpt["config"]["model"]["vocab_size"] == len(set(TEXT)), "the resolved config, not the requested one"
    assert ckpt["tokenizer"] == {"kind": "char", "chars": "".join(sorted(set(TEXT)))}
    assert set(ckpt["rng_ranks"][0]) >= {"numpy", "torch", "cuda"} and "generator" in ckpt["loader"]
    assert ckpt["optimizer"]["state"] and "scaler" in ckpt and ckpt["elapsed"] > 0
    assert ckpt["best_val_loss"] < 10 and ckpt["skipped_steps"] == 0


def test_the_last_k_checkpoints_and_the_true_best_are_kept(tiny_cfg, monkeypatch):
    vals = iter([3.0, 2.0, 2.5, 2.7, 2.9])   # the best (step 8) is not the last, and rotates out of ckpt_*
    monkeypatch.setattr("training.trainer.evaluate", lambda *a: {"train": 1.0, "val": next(vals)})
    cfg = tiny_cfg(**{"train.eval_interval": 4, "train.keep_checkpoints": 3})
    train(cfg, quiet=True)
    assert [s for s, _ in list_checkpoints(cfg.out_dir)] == [12, 16, 20]
    best = load_checkpoint(f"{cfg.out_dir}/best.pt")
    assert best["step"] == 8 and best["best_val_loss"] == 2.0
    assert load_checkpoint(f"{cfg.out_dir}/ckpt_0000020.pt")["best_val_loss"] == 2.0


def test_best_is_a_copy_where_hard_links_fail(tiny_cfg, monkeypatch):
    def no_links(*a):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    cfg = tiny_cfg(**{"train.max_steps": 4, "train.eval_interval": 2, "train.keep_checkpoints": 1})
    train(cfg, quiet=True)
    best, last = load_checkpoint(f"{cfg.out_dir}/best.pt"), load_checkpoint(f"{cfg.out_dir}/ckpt_0000004.pt")
    assert best["step"] == 4 and all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])


def test_a_checkpoint_that_would_run_code_is_refused_and_does_not(tmp_path, trained, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    good = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    torch.save({**good, "config": Evil(marker)}, evil)   # a checkpoint of ours in every other way
    with pytest.raises(UserError, match=r"refused.*GLOBAL posix.system"):
        load_checkpoint(evil)
    rc, _, err = run_tool(sample_cli, [evil, "--max-new-tokens", "5"], capsys)
    assert rc == 2 and "refused" in err
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(evil, out / "ckpt_0000004.pt")
    text = write(tmp_path / "tiny.txt", TEXT)
    rc, _, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text, out_dir=out), "--resume"], capsys)
    assert rc == 2 and "refused" in err
    assert not marker.exists(), "the pickled payload ran"
    torch.load(evil, weights_only=False)   # the control: an unrestricted load does run it
    assert marker.exists()


# ---------------------------------------------------------------- failures in the middle of a run

@pytest.mark.parametrize("failure, message", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "the disk is full (no space left on device)"),
    # what torch.save's zip writer raises when the disk fills (a RuntimeError, not an OSError)
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 2048"), "the disk is full"),
], ids=["OSError", "RuntimeError"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(failure, message, tmp_path, text_file, monkeypatch,
                                                                 capsys):
    real_save, calls = torch.save, []

    def save_until_the_disk_fills(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise failure
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and err.startswith("error: could not write the checkpoint") and len(err.splitlines()) == 1, err
    assert message in err and "ckpt_0000020.pt" in err and "the checkpoints written before are kept" in err, err
    out_dir = tmp_path / "out"
    assert sorted(p.name for p in out_dir.iterdir()) == [".lock", "best.pt", "ckpt_0000010.pt", "config.toml", "metrics.jsonl"]
    assert load_checkpoint(out_dir / "ckpt_0000010.pt")["step"] == 10


def test_out_of_memory_names_the_fix_and_keeps_the_checkpoint(tmp_path, text_file, monkeypatch, capsys):
    real_clip, calls = torch.nn.utils.clip_grad_norm_, []

    def clip_until_memory_runs_out(*a, **k):
        calls.append(1)
        if len(calls) == 13:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_clip(*a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_until_memory_runs_out)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and "out of memory" in err and "at step 13" in err, err
    assert "smaller --train.batch_size" in err and "--model.block_size" in err and len(err.splitlines()) == 1
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10]
    assert load_checkpoint(tmp_path / "out" / "ckpt_0000010.pt")["step"] == 10


@pytest.mark.parametrize("tool, argv, code, message", [
    ("train.py", lambda tmp, text, ckpt: tiny_overrides(tmp, text, **{"train.batch_size": 300_000_000,   # past the
                                                                      "train.check_memory": "false",   # estimate
                                                                      "train.device": "cpu"}), 2,
     "error: out of memory on cpu at step 1"),
    ("sample.py", lambda tmp, text, ckpt: [ckpt, "--num-samples", 100_000_000, "--max-new-tokens", 5, "--device", "cpu"], 3,
     "error: out of memory (DefaultCPUAllocator"),
], ids=["train batch", "sample batch"])
def test_memory_that_runs_out_for_real_is_one_line(tool, argv, code, message, tmp_path, trained):
    """Allocations that really fail (a process limited to 2 GB of address space): a batch of 300 million
    sequences to train, 10 million samples to generate."""
    text = write(tmp_path / "tiny.txt", TEXT)
    prepare_text(text, "char", 0.1, tmp_path / "prepared")
    before = tree(tmp_path)
    rc, out, err, _ = run_limited([tool, *argv(tmp_path, text, trained / "ckpt_0000004.pt")])
    lines = [l for l in err.splitlines() if not l.startswith("# ")]   # sample.py names the checkpoint first
    assert rc == code and len(lines) == 1 and lines[0].startswith(message), err[-2000:]
    assert "smaller" in lines[0] and tree(tmp_path) == before


# ---------------------------------------------------------------- non-finite loss or gradient

@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_a_non_finite_step_stops_the_run_naming_it(kind, tmp_path, text_file, monkeypatch, capsys):
    poison(monkeypatch, {13}, kind)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and f"non-finite {kind} at step 13" in err and "last good checkpoint (step 10) is kept" in err, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10]
    weights = load_checkpoint(tmp_path / "out" / "ckpt_0000010.pt")["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_skip_mode_drops_the_bad_updates_and_counts_them(tiny_cfg, monkeypatch):
    seen = poison(monkeypatch, {13, 15})
    cfg = tiny_cfg(**{"train.on_nonfinite": "skip"})
    summary = train(cfg, quiet=True)
    assert summary["step"] == 20 and summary["skipped_steps"] == 2
    # seen[i] is the weight after step i (as step i + 1's forward saw it)
    assert torch.equal(seen[13], seen[12]) and torch.equal(seen[15], seen[14]), "a skipped update was applied"
    assert not torch.equal(seen[12], seen[11]) and not torch.equal(seen[14], seen[13]), "a good update was dropped"
    records = [json.loads(l) for l in open(f"{cfg.out_dir}/metrics.jsonl")]
    assert [r["skipped_steps"] for r in records if r["kind"] == "train" and r["step"] in (12, 13, 20)] == [0, 1, 2]
    ckpt = load_checkpoint(f"{cfg.out_dir}/ckpt_0000020.pt")
    assert ckpt["skipped_steps"] == 2 and all(torch.isfinite(w).all() for w in ckpt["model"].values())


def test_skip_mode_still_stops_a_diverged_run(tiny_cfg, monkeypatch):
    poison(monkeypatch, set(range(3, 100)))
    with pytest.raises(UserError, match="at 10 steps in a row"):
        train(tiny_cfg(**{"train.on_nonfinite": "skip"}), quiet=True)


def test_the_device_side_record_names_the_first_bad_step():
    """The step records a non-finite loss or gradient norm on the device; the loop reads it later."""
    record = NonFinite(torch.device("cpu"), stop=True, check_grad=True)
    record.steps.fill_(40)   # a resumed run counts on from its checkpoint's step
    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    assert [int(record.record(*pair)) for pair in ((one, one), (one, nan), (nan, one))] == [0, -1, 1]
    with pytest.raises(UserError, match="non-finite gradient at step 42; stopped, no checkpoint had been written"):
        record.check(None)
    fine = NonFinite(torch.device("cpu"), stop=True, check_grad=True)
    fine.record(one, one)
    fine.check(None)


def numpy_memory_error() -> MemoryError:
    """The exception numpy raises when an array does not fit (its own MemoryError subclass)."""
    try:
        np.empty(1 << 60, np.uint8)
    except MemoryError as e:
        return e
    raise AssertionError("numpy allocated an exbibyte")


def fail_in_forward(monkeypatch, step, error):
    """Make the training forward of the given (1-based) step raise error."""
    real_forward, calls = GPT.forward, []

    def forward(self, idx, targets=None, **kw):
        if self.training and targets is not None:
            calls.append(1)
            if len(calls) == step:
                raise error
        return real_forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", forward)


@pytest.mark.parametrize("existing", [False, True], ids=["new out dir", "existing out dir"])
@pytest.mark.parametrize("make_failure, extra, pattern", [
    (lambda mp: poison(mp, {1}), {}, r"non-finite loss at step 1; stopped, no checkpoint had been written yet"),
    (lambda mp: fail_in_forward(mp, 3, numpy_memory_error()), {},
     r"out of memory on \S+ at step 3 \(Unable to allocate 1.00 EiB.*no checkpoint had been written yet"),
    (lambda mp: fail_in_forward(mp, 3, RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 1000000000000 bytes. Error code 12 (Cannot allocate memory)")), {},
     r"out of memory on \S+ at step 3 \(DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000000000000"
     r".*no checkpoint had been written yet"),
    (lambda mp: fail_in_forward(mp, 3, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")), {},
     r"out of memory on \S+ at step 3 \(CUDA out of memory. Tried to allocate 20.00 GiB\).*no checkpoint had been written"),
    (lambda mp: mp.setitem(sys.modules, "wandb", None), {"log.wandb": "true"},   # `import wandb` fails
     r"^error: log.wandb = true but wandb is not installed \(pip install wandb\)$"),
], ids=["NaN loss", "numpy MemoryError", "CPU allocator", "torch OutOfMemoryError", "no wandb"])
def test_a_run_that_fails_before_its_first_checkpoint_leaves_the_out_dir_as_it_was(
        make_failure, extra, pattern, existing, tmp_path, text_file, monkeypatch, capsys):
    prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    overwrite = []
    if existing:   # with --overwrite, files of the names a run writes are set aside, and come back
        out = mkdir(tmp_path / "out")
        for name in ("notes.txt", "config.toml", "metrics.jsonl"):
            write(out / name, "the user's own")
        overwrite = ["--overwrite"]
    before = tree(tmp_path)
    make_failure(monkeypatch)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file, **extra) + overwrite, capsys)
    assert rc == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, (rc, err)
    assert re.search(pattern, err) and "checkpoint is kept" not in err, err
    assert settled(tree(tmp_path)) == settled(before), "the failed run left files behind"


# ---------------------------------------------------------------- memory

def test_a_run_that_cannot_fit_in_memory_is_refused_before_it_allocates(tmp_path):
    """A block of 100,000 tokens on tinyshakespeare needs tens of GB a step: refused at once, in one line, with
    nothing written (a real process, its address space limited to 2 GB: were it to start, it would fail)."""
    args = ["train.py", "--model.block_size=100000", f"--data.prepared_dir={tmp_path / 'p'}", f"--out_dir={tmp_path / 'out'}"]
    rc, out, err, peak = run_limited(args)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: one training step needs about "), err
    assert "GB free on cpu" in err and "--model.block_size" in err and "--train.check_memory=false" in err, err
    assert not (tmp_path / "out").exists() and peak < 1 << 30


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures peak memory through Linux's /proc")
def test_the_memory_estimate_is_the_measured_peak_within_a_factor_of_two(tiny_cfg):
    """One real step's peak resident memory against step_memory's estimate, fp32 on CPU."""
    from model.gpt import GPT
    from training.device import step_memory

    def peak_rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
    cfg = tiny_cfg(**{"model.n_embd": 128, "model.n_head": 2, "model.block_size": 256, "train.batch_size": 32})
    cfg.model.vocab_size = 65
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randint(0, 65, (32, 256))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset the high-water mark to what is resident now
    before = peak_rss()
    model(x, x)[1].backward()
    optimizer.step()
    measured = peak_rss() - before
    state, activations = step_memory(cfg, sum(p.numel() for p in model.parameters()), torch.float32)
    assert measured / 2 < state + activations < measured * 2, (measured, state, activations)


def test_best_pt_relinked_to_itself_leaves_no_temporary_link_and_the_checkpoint_whole(tiny_cfg):
    from training.checkpoint import link_best
    cfg = tiny_cfg(**{"train.max_steps": 2, "train.eval_interval": 2})
    train(cfg, quiet=True)
    ckpt = Path(cfg.out_dir) / "ckpt_0000002.pt"
    size = ckpt.stat().st_size
    link_best(ckpt)   # as a resume from the best checkpoint does
    link_best(ckpt)
    assert os.path.samefile(Path(cfg.out_dir) / "best.pt", ckpt) and ckpt.stat().st_size == size
    assert not (Path(cfg.out_dir) / ".best.pt.tmp").exists()


def test_an_overwrite_that_fails_to_open_the_out_dir_keeps_the_earlier_run(tmp_path, text_file, monkeypatch,
                                                                          capsys):
    out, args = tmp_path / "out", tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    earlier = {k: v for k, v in tree(out).items() if k != ".lock"}

    def no_room(fd, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "ftruncate", no_room)   # the PID cannot be written: the out dir's first write
    rc, _, err = run_tool(train_cli, [*args, "--overwrite"], capsys)
    assert rc == 2 and "cannot write to the out dir" in err, err
    assert {k: v for k, v in tree(out).items() if k != ".lock"} == earlier


def test_under_fsdp_the_memory_check_counts_each_process_s_share_of_the_state(tiny_cfg):
    from training.device import check_memory
    cfg = tiny_cfg(**{"model.vocab_size": 48, "model.n_embd": 256, "model.n_layer": 4, "train.fsdp": "true"})
    one, four = (check_memory(cfg, torch.device("cpu"), torch.float32, world) for world in (1, 4))
    share = lambda words: float(re.search(r"weights and optimizer ([\d.]+) MB", words)[1])   # noqa: E731
    assert share(one) > 8 and share(four) == pytest.approx(share(one) / 4, abs=1), (one, four)
