"""The machine a measurement is taken on (benchmarks and ablation reports print it), and the peak
memory of a process that measures itself."""
import os
import platform
import sys


def cpu_name() -> str:
    """The processor's name: /proc/cpuinfo's first 'model name' on Linux, else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(v.strip() for k, _, v in (line.partition(":") for line in f) if k.strip() == "model name")
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> str:
    """One line naming this machine: what a measurement was taken on."""
    import torch   # (not at the top: a process measuring its own memory imports this module)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.machine()}, {cpu_name()} x {os.cpu_count()} cores, {gpu}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def header() -> str:
    """What every benchmark prints first: the CPU, the OpenMP wait policy (spinning threads are fastest
    on an idle machine, but take the cores other jobs need on a busy one) and the load."""
    load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown here"   # (none on Windows)
    return (f"# {cpu_name()} x {os.cpu_count()} | OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
            f"load average {load} (other jobs slow every figure)")


def peak_memory() -> int | None:
    """This process's peak resident bytes so far: its VmHWM in /proc (not getrusage's maxrss, into which
    Linux carries the memory of the parent the process was forked from), else getrusage's where there
    is no /proc, else None (Windows)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
