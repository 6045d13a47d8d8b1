"""A real Prometheus and a real Alertmanager (Debian's `prometheus` and `prometheus-alertmanager`)
for the rotation end-to-end test: on free loopback ports, in a temporary folder, on a 1 s clock."""
from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _exe(name: str, package: str) -> str:
    exe = shutil.which(name)
    assert exe, f"{name} not found: install the Debian package `{package}` (make syspkgs)"
    return exe


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready:\n{log.read_text()[-3000:]}")


class Process:
    def __init__(self, argv: list[str], ready_url: str, log: Path):
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        _wait_ready(ready_url, self.proc, log)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_alertmanager(tmp: Path, webhook_url: str, token_file: Path) -> tuple[Process, str]:
    """deploy/alertmanager/alertmanager.yml with the webhook's URL and token file, and second-scale timings."""
    cfg = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    cfg["global"]["resolve_timeout"] = "5s"
    route = next(r for r in cfg["route"]["routes"] if r["receiver"] == "keel-rotation")
    route.update(group_wait="0s", group_interval="1s", repeat_interval="1h")
    hook = next(r for r in cfg["receivers"] if r["name"] == "keel-rotation")["webhook_configs"][0]
    hook["url"] = webhook_url
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    argv = [_exe("prometheus-alertmanager", "prometheus-alertmanager"), f"--config.file={tmp / 'alertmanager.yml'}",
            f"--storage.path={tmp / 'alertmanager'}", f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address="]  # no HA gossip port
    url = f"http://127.0.0.1:{port}"
    return Process(argv, f"{url}/-/ready", tmp / "alertmanager.log"), url


def start_prometheus(tmp: Path, rules: str, targets: list[str], alertmanager: str) -> tuple[Process, str]:
    (tmp / "rules.yml").write_text(rules)
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(tmp / "rules.yml")],
           "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager.split("//", 1)[1]]}]}]},
           "scrape_configs": [{"job_name": "keel", "static_configs": [{"targets": targets}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    argv = [_exe("prometheus", "prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'prometheus'}", f"--web.listen-address=127.0.0.1:{port}"]
    url = f"http://127.0.0.1:{port}"
    return Process(argv, f"{url}/-/ready", tmp / "prometheus.log"), url
