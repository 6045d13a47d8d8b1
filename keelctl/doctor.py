"""`keel doctor`: is this host ready for a first `keel up`? Each check prints what it found and, when
something is wrong, what to do about it.

    keel doctor          exit 0: nothing blocks a start (warnings may remain); 1: something does

Checks, in order: the CPU's flags (/proc/cpuinfo) and the weight formats they run and accelerate
(the formats are services/inference/model/loader.py's FORMATS; the configured engine.format must run here),
the C++ compiler a format with a C++ kernel needs, free memory against the inference stage's
engine.memory_budget_bytes, the mesh's ports (config/keel.yaml, the feedback stage's
rotation webhook's included) free, the Redis `keel up` starts
(redis-server) or the one the validator is configured with, the feedback stage's PostgreSQL when
configured, and the model folder and tokenizer vocabulary `make model` and `make vocab` write.
"""
from __future__ import annotations

import shutil
import socket
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

OK, WARN, FAIL = "ok", "warn", "FAIL"
CONNECT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Finding:
    check: str
    status: str        # OK | WARN | FAIL (FAIL blocks a start)
    what: str
    fix: str = ""


@dataclass(frozen=True)
class FormatNeeds:
    """What a weight format asks of the host: CPU flags that accelerate it (any one), a tool it runs."""

    fast_with: tuple[str, ...] = ()
    tool: str = ""         # an executable the format builds its kernel with
    note: str = ""
    without: str = ""      # what lacking every flag of fast_with costs


# What each weight format asks of a CPU host. A format missing here has no known host requirement.
FORMAT_NEEDS = {
    "float32": FormatNeeds(("avx512f", "avx2"), note="the reference; runs on any x86-64"),
    "bfloat16": FormatNeeds(("avx512_bf16", "amx_bf16"), without="bfloat16 math is emulated (slow)"),
    "float16": FormatNeeds(("avx512_fp16", "amx_fp16"), without="float16 math is emulated (slow)"),
    "int8": FormatNeeds(("avx512_vnni", "avx512f", "avx2"), note="weight-only kernel, bfloat16 activations"),
    "int4": FormatNeeds(("avx512f", "avx2"), note="weight-only kernel, bfloat16 activations"),
    "gguf": FormatNeeds(("avx512_vnni", "avx2"), tool="g++", note="a C++ kernel compiled on the host"),
    "gguf_f32": FormatNeeds(("avx512f", "avx2"), tool="g++", note="a C++ kernel compiled on the host"),
}


@dataclass(frozen=True)
class Host:
    """What the checks read: the host's files and tools, and the mesh's configuration."""

    inference: object                 # services.inference.config.InferenceConfig
    layout: object                    # keelctl.layout.Layout
    vocab_file: Path
    redis_url: str                    # the validator's quarantine.redis_url
    database_url: str                 # the feedback stage's database.url ("" -> SQLite)
    formats: tuple[str, ...] = ()     # every weight format this build knows
    cpuinfo: Path = Path("/proc/cpuinfo")
    meminfo: Path = Path("/proc/meminfo")
    which: object = field(default=shutil.which)
    model_problem: str = ""           # why the chosen model is not one (shared/modelfile.py), else ""

    @classmethod
    def configured(cls) -> "Host":
        from keelctl.layout import load_layout
        from services.feedback import config as feedback_config
        from services.inference import config as inference_config
        from services.inference.model.loader import FORMATS
        from services.tokenizer import config as tokenizer_config
        from services.tokenizer.compiler import compiled_path
        from services.validator import config as validator_config
        from shared import modelfile
        from shared.config import ROOT_DIR, ConfigError

        inference, vocab = inference_config.load(), Path(tokenizer_config.load().vocab_file)
        try:
            source, problem = modelfile.source(), ""
            inference = replace(inference, model_path=str(source.cache_dir))
            vocab = (vocab if vocab.is_absolute() else ROOT_DIR / vocab) if vocab.name else compiled_path(source)
        except ConfigError as exc:
            problem = str(exc).split(": ", 1)[-1]
        return cls(inference, load_layout(), vocab, validator_config.load().quarantine.redis_url,
                   feedback_config.load().database.url, FORMATS, model_problem=problem)


def cpu_flags(host: Host) -> set[str]:
    for line in host.cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def check_cpu(host: Host) -> list[Finding]:
    """One finding per weight format: whether it runs here and what accelerates it; only the
    configured engine.format failing to run blocks the start."""
    from services.inference.model.loader import check_format
    from shared.errors import InvalidInput

    flags = cpu_flags(host)
    e = host.inference.engine
    out = []
    for fmt in host.formats:
        needs = FORMAT_NEEDS.get(fmt, FormatNeeds())
        problems = []
        try:
            check_format(fmt, e.device)
        except InvalidInput as exc:
            problems.append(exc.message)
        if needs.tool and not host.which(needs.tool):
            problems.append(f"needs a C++ compiler ({needs.tool}) to build its kernel; none on PATH")
        fast = [f for f in needs.fast_with if f in flags]
        speed = (f"accelerated by {', '.join(fast)}" if fast else
                 f"no {' / '.join(needs.fast_with)} on this CPU" if needs.fast_with else "")
        what = "; ".join(x for x in (speed, needs.note, "" if fast else needs.without) if x)
        if problems:
            blocks = e.format == fmt
            fix = (f"install {needs.tool} (apt-get install {needs.tool})" if needs.tool and not host.which(needs.tool)
                   else "choose another engine.format (config/inference.yaml) or auto")
            out.append(Finding(f"format {fmt}", FAIL if blocks else WARN,
                               f"does not run here: {'; '.join(problems)}" + (
                                   "" if blocks else " (blocks a start only where engine.format names it)"), fix))
        else:
            out.append(Finding(f"format {fmt}", OK, f"runs{': ' + what if what else ''}"))
    if not flags & {"avx2", "avx512f"}:
        out.append(Finding("cpu", WARN, "neither avx2 nor avx512f: every format runs on torch's scalar kernels",
                           "expect a slow engine; a host with AVX2 or AVX-512 runs torch's vector kernels"))
    return out


def mem_available(host: Host) -> int:
    for line in host.meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no MemAvailable in {host.meminfo}")


def check_memory(host: Host) -> list[Finding]:
    budget = host.inference.engine.memory_budget_bytes
    free = mem_available(host)
    what = f"{free / 2**30:.1f} GiB available, inference budget {budget / 2**30:.1f} GiB"
    if free < budget:
        return [Finding("memory", FAIL, what, f"free {(budget - free) / 2**30:.1f} GiB or lower "
                                              "engine.memory_budget_bytes (config/inference.yaml)")]
    return [Finding("memory", OK, what)]


def check_ports(host: Host) -> list[Finding]:
    from keelctl import procs
    from keelctl.layout import read_state
    from keelctl.supervisor import layout_ports

    needed = layout_ports(host.layout)
    held = procs.held_ports(needed)
    if not held:
        return [Finding("ports", OK, f"{len(needed)} ports free ({', '.join(map(str, sorted(needed)))})")]
    if procs.is_supervisor(read_state().get("pid")):
        return [Finding("ports", WARN, f"keel is running and holds {len(held)} of its ports", "`keel down` first")]
    return [Finding("ports", FAIL, f"port {h.port} ({h.what}) is held by "
                                   + (f"pid {h.pid}: {h.command}" if h.pid else "an unknown process"),
                    "stop that process or move the port in config/keel.yaml") for h in held]


def _reachable(url: str) -> str:
    """"" when host:port of `url` accepts a TCP connection, else why not."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), CONNECT_TIMEOUT_S):
            return ""
    except OSError as exc:
        return str(exc)


def check_redis(host: Host) -> list[Finding]:
    """`keel up` starts its own Redis on the layout's port (the validator is pointed at it); a
    validator configured with another Redis needs that one reachable."""
    own = urlsplit(host.redis_url)
    if own.hostname in ("127.0.0.1", "localhost") and own.port == host.layout.redis.port:
        server = host.which("redis-server")
        if server:
            return [Finding("redis", OK, f"keel up starts {server} on port {host.layout.redis.port}")]
        return [Finding("redis", FAIL, "redis-server not found (keel up starts it for the quarantine)",
                        "apt-get install redis-server (make syspkgs)")]
    from redis import Redis, RedisError
    try:
        Redis.from_url(host.redis_url, socket_timeout=CONNECT_TIMEOUT_S,
                       socket_connect_timeout=CONNECT_TIMEOUT_S).ping()
    except RedisError as exc:
        return [Finding("redis", FAIL, f"{own.hostname}:{own.port} (quarantine.redis_url): {exc}",
                        "start that Redis or fix KEEL_VALIDATOR_QUARANTINE__REDIS_URL / config/validator.yaml")]
    return [Finding("redis", OK, f"{own.hostname}:{own.port} answers PING")]


def check_database(host: Host) -> list[Finding]:
    if not host.database_url:
        return [Finding("database", OK, "SQLite under var/feedback (feedback database.url empty)")]
    import sqlalchemy
    where = urlsplit(host.database_url)
    try:
        engine = sqlalchemy.create_engine(host.database_url, connect_args={"connect_timeout": int(CONNECT_TIMEOUT_S)}
                                          if where.scheme.startswith("postgresql") else {})
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
        engine.dispose()
    except Exception as exc:  # any driver's failure to connect is the finding, not a crash of doctor
        return [Finding("database", FAIL, f"{where.scheme} at {where.hostname}:{where.port}: "
                                          f"{str(exc).splitlines()[0][:200]}",
                        "start the database or fix KEEL_FEEDBACK_DATABASE__URL / config/feedback.yaml")]
    return [Finding("database", OK, f"{where.scheme} at {where.hostname}:{where.port} answers")]


def check_files(host: Host) -> list[Finding]:
    if host.model_problem:
        return [Finding("model", FAIL, host.model_problem, "set model.path in config/keel.yaml or KEEL_MODEL")]
    model = Path(host.inference.model_dir)
    out = []
    if (model / "config.json").is_file() and list(model.glob("*.safetensors")):
        out.append(Finding("model", OK, str(model)))
    else:
        out.append(Finding("model", FAIL, f"no model at {model} (config.json and *.safetensors)", "make model"))
    if host.vocab_file.is_file():
        out.append(Finding("vocabulary", OK, str(host.vocab_file)))
    else:
        out.append(Finding("vocabulary", FAIL, f"no tokenizer vocabulary at {host.vocab_file}", "make vocab"))
    return out


CHECKS = (check_cpu, check_memory, check_ports, check_redis, check_database, check_files)


def run(host: Host) -> list[Finding]:
    return [f for check in CHECKS for f in check(host)]


def report(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"{f.status:<4} {f.check:<16} {f.what}")
        if f.fix and f.status != OK:
            lines.append(f"{'':<4} {'':<16} fix: {f.fix}")
    blocking = sum(f.status == FAIL for f in findings)
    lines.append(f"{blocking} problem(s) block a start" if blocking else "nothing blocks a start")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    from shared.config import ConfigError
    argparse.ArgumentParser(prog="keel doctor", description="check this host before a first start").parse_args(argv)
    try:
        findings = run(Host.configured())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(findings))
    return 1 if any(f.status == FAIL for f in findings) else 0
