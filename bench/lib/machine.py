"""What every benchmark states about the machine it ran on (docs/BENCHMARKS.md rows carry it): the CPU
flags that pick Keel's kernel paths, the cores, the load average at the end of the run, and the commit."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu_flags() -> str:
    """The instruction sets the kernels choose between (AVX2, AVX-512 and its VNNI/BF16, AMX)."""
    text = Path("/proc/cpuinfo").read_text()
    return " ".join(sorted(set(re.findall(r"\b(avx2|avx512f|avx512_vnni|avx512_bf16|amx[a-z_]*)\b", text))))


def machine_line() -> str:
    """One line: CPU flags, cores, load average now (call it at the end of the run), git commit."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return (f"CPU flags: {cpu_flags()}; {os.cpu_count()} cores; load average at the end "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; git {sha.strip()}")
