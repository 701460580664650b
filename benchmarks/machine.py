"""The machine a measurement was taken on, in one line (benchmarks and ablation reports print it)."""
import os
import platform

import torch


def cpu_name() -> str:
    """The processor's name: /proc/cpuinfo's first 'model name' on Linux, else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line naming this machine: what a measurement was taken on."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.machine()}, {cpu_name()} x {os.cpu_count()} cores, {gpu}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def header() -> str:
    """What every benchmark prints first: the CPU, the OpenMP wait policy and the load, which slow or
    speed every figure."""
    try:
        load = f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):   # no load average (Windows)
        load = "unknown here"
    return (f"# {cpu_name()} x {os.cpu_count()} | OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
            f"load average {load} (other jobs slow every figure)")
