"""`keel doctor`: each check on a host made of temporary files, free ports and real servers, in its
passing and its failing case; and the command's exit status."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from keelctl import doctor
from keelctl.doctor import FAIL, OK, WARN, Host
from keelctl.layout import Layout, RedisLayout, StageLayout, StagesLayout
from services.inference.config import InferenceConfig
from services.inference.engine.core import EngineConfig
from testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def layout(*ports: int) -> Layout:
    return Layout(redis=RedisLayout(port=free_port()),
                  stages=StagesLayout(gateway=StageLayout(ports=tuple(ports) or (free_port(),))))


@pytest.fixture
def host(tmp_path) -> Host:
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    (tmp_path / "meminfo").write_text(f"MemTotal: {16 * GIB // 1024} kB\nMemAvailable: {8 * GIB // 1024} kB\n")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    (tmp_path / "vocab.kvoc").write_bytes(b"")
    lay = layout()
    inference = InferenceConfig(model_path=str(model_dir),
                                engine=EngineConfig(memory_budget_bytes=3 * GIB, format="auto"))
    return Host(inference, lay, tmp_path / "vocab.kvoc", f"redis://127.0.0.1:{lay.redis.port}/0", "",
                ("float32", "int8", "gguf"), tmp_path / "cpuinfo", tmp_path / "meminfo",
                which=lambda name: f"/usr/bin/{name}")


def by_check(findings) -> dict[str, doctor.Finding]:
    return {f.check: f for f in findings}


def test_cpu_flags_say_what_each_format_runs_with(host):
    found = by_check(doctor.check_cpu(host))
    assert found["format float32"].status == OK and "accelerated by avx2" in found["format float32"].what
    assert found["format int8"].status == OK and "avx2" in found["format int8"].what
    assert found["format gguf"].status == OK
    assert "cpu" not in found  # avx2 is there


def test_a_cpu_without_vector_flags_is_warned(host):
    host.cpuinfo.write_text("flags\t\t: fpu sse2\n")
    found = by_check(doctor.check_cpu(host))
    assert found["cpu"].status == WARN and "neither avx2 nor avx512f" in found["cpu"].what
    assert "no avx512_vnni / avx512f / avx2" in found["format int8"].what


def test_without_a_cpp_compiler_gguf_cannot_run_and_blocks_only_when_configured(host):
    host = replace(host, which=lambda name: None)
    gguf = by_check(doctor.check_cpu(host))["format gguf"]
    assert gguf.status == WARN and "g++" in gguf.what and "only where engine.format names it" in gguf.what
    assert "g++" in gguf.fix
    chosen = replace(host, inference=replace(host.inference, engine=replace(host.inference.engine, format="gguf")))
    assert by_check(doctor.check_cpu(chosen))["format gguf"].status == FAIL


def test_on_cuda_the_cpu_only_formats_are_warned_not_blocking_under_auto(host):
    cuda = replace(host, inference=replace(host.inference, engine=replace(host.inference.engine, device="cuda")))
    found = by_check(doctor.check_cpu(cuda))
    assert found["format int8"].status == WARN and "CPU only" in found["format int8"].what
    assert found["format float32"].status == OK


def test_memory_against_the_inference_budget(host):
    assert doctor.check_memory(host)[0].status == OK
    small = replace(host, inference=replace(host.inference, engine=replace(host.inference.engine,
                                                                           memory_budget_bytes=12 * GIB)))
    finding = doctor.check_memory(small)[0]
    assert finding.status == FAIL and "8.0 GiB available" in finding.what and "4.0 GiB" in finding.fix


def test_a_held_port_is_named_with_its_holder(host):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        held = doctor.check_ports(replace(host, layout=layout(port)))
        assert [f.status for f in held] == [FAIL] and f"port {port} (gateway-0)" in held[0].what
        assert f"pid {os.getpid()}" in held[0].what
    assert [f.status for f in doctor.check_ports(replace(host, layout=layout(port)))] == [OK]


def test_the_feedback_webhook_port_is_checked_too(host):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        stages = replace(host.layout.stages, feedback=StageLayout(ports=(free_port(),), webhook_ports=(port,)))
        held = doctor.check_ports(replace(host, layout=replace(host.layout, stages=stages)))
    assert [f.status for f in held] == [FAIL] and f"port {port} (feedback-0 webhook)" in held[0].what


def test_the_redis_keel_up_starts_needs_redis_server(host):
    assert doctor.check_redis(host)[0].status == OK
    missing = doctor.check_redis(replace(host, which=lambda name: None))[0]
    assert missing.status == FAIL and "redis-server" in missing.fix


def test_a_configured_redis_must_answer(host, tmp_path):
    port = free_port()
    other = replace(host, redis_url=f"redis://127.0.0.1:{port}/0")
    assert doctor.check_redis(other)[0].status == FAIL
    server = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port),
                               "--save", "", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while doctor._reachable(other.redis_url) and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.05)
        assert doctor.check_redis(other)[0].status == OK
    finally:
        server.terminate()
        server.wait()


def test_a_configured_postgresql_must_answer(host):
    from testing.postgres import PgServer
    down = replace(host, database_url=f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres")
    finding = doctor.check_database(down)[0]
    assert finding.status == FAIL and "postgresql" in finding.what and "DATABASE__URL" in finding.fix
    pg = PgServer().init()
    pg.start()
    try:
        assert doctor.check_database(replace(host, database_url=pg.url))[0].status == OK
    finally:
        pg.stop()
    assert doctor.check_database(host)[0].status == OK  # "" is SQLite


def test_model_and_vocabulary_present(host):
    assert [f.status for f in doctor.check_files(host)] == [OK, OK]
    (Path(host.inference.model_dir) / "model.safetensors").unlink()
    host.vocab_file.unlink()
    found = by_check(doctor.check_files(host))
    assert (found["model"].status, found["model"].fix) == (FAIL, "make model")
    assert (found["vocabulary"].status, found["vocabulary"].fix) == (FAIL, "make vocab")


def test_the_report_says_what_to_fix_and_counts_what_blocks(host):
    host.vocab_file.unlink()
    text = doctor.report(doctor.run(host))
    assert "FAIL vocabulary" in text and "fix: make vocab" in text and text.endswith("1 problem(s) block a start")


@pytest.mark.slow
def test_keel_doctor_exits_non_zero_when_something_blocks(tmp_path):
    env = dict(os.environ, KEEL_MODEL=str(tmp_path / "no-model"), KEEL_VAR_DIR=str(tmp_path / "var"))
    out = subprocess.run([sys.executable, "-m", "keelctl", "doctor"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"no file or folder at {tmp_path / 'no-model'}" in out.stdout and "KEEL_MODEL" in out.stdout
