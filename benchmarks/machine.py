"""The machine a measurement was taken on, in one line (benchmarks and ablation reports print it)."""
import os
import platform

import torch


def cpuinfo(field: str, path: str = "/proc/cpuinfo") -> str:
    """A field of the first processor in /proc/cpuinfo ('model name' -> the processor's name); '' where
    there is no such file (not Linux) or field."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


def machine() -> str:
    """One line naming this machine: what a measurement was taken on."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.machine()}, {cpu_name()} x {os.cpu_count()} cores, {gpu}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def load_average() -> float | None:
    """The system's load average over the last minute; None where the system does not tell it (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def header() -> str:
    """What every benchmark prints first: the CPU, the OpenMP wait policy and the load, which slow or
    speed every figure."""
    load = load_average()
    return (f"# {cpu_name()} x {os.cpu_count()} | OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
            f"load average {'unknown here' if load is None else f'{load:.2f}'} (other jobs slow every figure)")
