"""Fixtures for tests/deploy: every Kubernetes overlay rendered once per session with kubectl kustomize."""
from __future__ import annotations

import pytest
import yaml

from tests.deploy.k8s_objects import K8S, OVERLAYS, kustomize


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """{overlay: [every object it renders]}."""
    out = {}
    for overlay in OVERLAYS:
        done = kustomize(K8S / "overlays" / overlay)
        assert done.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{done.stderr}"
        out[overlay] = [d for d in yaml.safe_load_all(done.stdout) if d]
    return out
