"""Where each stage listens, once: the `stages` block of config/keel.yaml.

`keel up` starts the mesh on those ports (keelctl/layout.py), and every stage's own config takes
its listening ports and its upstreams' addresses from there wherever its file does not set them
(shared/config.load), so a stage started alone (`python -m services.inference`), in an image or
under the supervisor listens where the others look for it. Manifests that cannot read the file
(deploy/k8s, docker-compose.yml, the Dockerfile's EXPOSE) state the ports again; tests/deploy
holds them to this one.
"""
from __future__ import annotations

from pathlib import Path

import yaml

LOOPBACK = "127.0.0.1"  # where the stages of one host find each other


class Topology:
    """The stages' ports as the layout file at `path` has them (none when there is no such file:
    each stage's own config must then set its ports)."""

    def __init__(self, path: Path):
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            data = {}
        self._stages: dict[str, dict] = data.get("stages") or {}

    def listed(self, stage: str, key: str) -> list[int]:
        """One of the stage's port lists, one port per replica: "ports", "metrics_ports" or
        "webhook_ports" (the feedback stage's rotation webhook)."""
        return list(self._stages.get(stage, {}).get(key, ()))

    def ports(self, stage: str) -> list[int]:
        return self.listed(stage, "ports")

    def metrics_ports(self, stage: str) -> list[int]:
        return self.listed(stage, "metrics_ports")

    def targets(self, stage: str) -> list[str]:
        """The loopback addresses of `stage`'s replicas, in order."""
        return [f"{LOOPBACK}:{p}" for p in self.ports(stage)]
