"""CMAKE_ARGS for building llama-cpp-python, the peer the model tests compare against, on this host.

llama.cpp's GGML_NATIVE=ON builds for `-march=native`, and on Intel hosts with AMX its AMX path dies
with SIGSEGV on the first Q4_1/Q8_0 matmul (llama-cpp-python 0.3.36); GGML_AMX_INT8=OFF alone does not
help under GGML_NATIVE. So the build names the SIMD extensions this CPU has, from /proc/cpuinfo, with
native detection and AMX off, on every host.

Run: python -m testing.llamacpp_flags   (prints the CMAKE_ARGS; the Makefile's `llamacpp` target uses it)
"""
from __future__ import annotations

from pathlib import Path

# ggml's CMake option for each /proc/cpuinfo flag it can use on x86.
_OPTIONS = {
    "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
    "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI",
}
_ALWAYS = ("-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
           "-DGGML_OPENMP=OFF", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF")


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str]) -> str:
    named = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _OPTIONS.items()]
    return " ".join((*_ALWAYS, *named))


if __name__ == "__main__":
    print(cmake_args(cpu_flags(Path("/proc/cpuinfo").read_text())))
