"""A CPU run leaves other processes their cores: beside a process that keeps one of its two cores
busy, it trains with one thread (two would wait for each other at every operation); a thread
count the user sets is kept."""
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides

two_cores = pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2,
                               reason="needs Linux's CPU affinity and two cores to pin processes to")


def banner_beside_a_busy_core(tmp_path, text_file, **env) -> str:
    """The device part of the banner of a tiny run on two cores, one of which another process keeps
    busy from before the run starts."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, cores[:1]))
    try:
        argv = [sys.executable, str(ROOT / "train.py"), *tiny_overrides(tmp_path, text_file)]
        plain = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        done = subprocess.run(argv, capture_output=True, text=True, env=plain | env, timeout=300,
                              preexec_fn=lambda: os.sched_setaffinity(0, cores))
    finally:
        spin.kill()
        spin.wait()
    assert done.returncode == 0, done.stderr
    return next(line for line in done.stdout.splitlines() if "parameters" in line)


@two_cores
def test_a_cpu_run_beside_a_busy_core_trains_with_one_thread(tmp_path, text_file):
    assert "| cpu x 1 thread," in banner_beside_a_busy_core(tmp_path, text_file)


@two_cores
def test_a_thread_count_the_user_sets_is_kept(tmp_path, text_file):
    banner = banner_beside_a_busy_core(tmp_path, text_file, OMP_NUM_THREADS="2")
    assert "| cpu x 2 threads," in banner
