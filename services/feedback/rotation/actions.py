"""What each ``keel_action`` does. Every action is idempotent (the executor may run it again after
a failed try or a restart) and all-or-nothing: it either completes or undoes what it did and raises.

- ``switch_variant``: SetVariant(labels.variant) on every inference replica; a replica that fails
  switches the others back to what they served before. Reversible: the resolved alert switches
  every replica back to the primary variant.
- ``retrain_adapters``: one retrain request record per adapter in use (the alert's ``adapter``
  label, comma-separated, or else every adapter an inference replica reports as accepted).
- ``resample_data``: an ETL run over ``rotation.resample.since`` into a new dataset folder, its
  shuffle seed drawn from the decision id (services/feedback/etl.py).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from services.feedback import etl
from services.feedback.config import EtlConfig, RotationConfig
from services.feedback.rotation.decisions import Decision, Decisions
from services.feedback.rotation.inference import InferenceFleet
from services.feedback.store import now_ms
from shared import errors
from shared.durations import parse_duration

log = logging.getLogger("keel.feedback.rotation")
REVERSIBLE = ("switch_variant",)


class NothingToDo(Exception):
    """The action has nothing to act on (recorded as skipped, with this message)."""


class Actions:
    def __init__(self, cfg: RotationConfig, etl_cfg: EtlConfig, fleet: InferenceFleet):
        self.cfg, self.etl_cfg, self.fleet = cfg, etl_cfg, fleet

    async def run(self, decisions: Decisions, d: Decision, *, revert: bool) -> dict:
        """Do (or, with ``revert``, undo) decision ``d``'s action; the result to record."""
        if d.action == "switch_variant":
            variant = self.cfg.primary_variant if revert else d.labels.get("variant", "")
            if not variant:
                raise NothingToDo("the alert has no variant label")
            return await self.switch_variant(variant, f"rotation:{d.id}")
        if d.action == "retrain_adapters":
            return await self.retrain_adapters(decisions, d)
        if d.action == "resample_data":
            return await asyncio.to_thread(self.resample_data, decisions, d)
        raise NothingToDo(f"unknown action {d.action!r}")

    async def switch_variant(self, variant: str, actor: str) -> dict:
        if not self.fleet.targets:
            raise NothingToDo("no inference replica is configured (rotation.inference)")
        done: dict[str, dict] = {}
        try:
            for target in await self.fleet.replicas():
                r = await self.fleet.set_variant(target, variant, actor)
                done[target] = {"previous": r.previous, "active": r.active}
        except errors.KeelError as exc:
            for target, state in done.items():  # never half-applied: the switched ones go back
                try:
                    await self.fleet.set_variant(target, state["previous"], f"{actor}:undo")
                except errors.KeelError as undo_exc:
                    log.error("could not switch a replica back", extra={"target": target, "error": str(undo_exc)})
            raise errors.NotReady(f"SetVariant({variant}) failed on a replica ({exc.reason}: {exc}); the others "
                                  "were switched back", reason="VARIANT_SWITCH_FAILED") from exc
        return {"variant": variant, "replicas": done}

    async def _adapters_in_use(self, labels: dict) -> list[tuple[str, str]]:
        if labels.get("adapter"):
            return sorted({(a.strip(), labels.get("adapter_version", "")) for a in labels["adapter"].split(",")
                           if a.strip()})
        found: set[tuple[str, str]] = set()
        for target in await self.fleet.replicas():
            try:
                listed = await self.fleet.list_adapters(target)
            except errors.KeelError as exc:
                if getattr(exc, "code", "") == "UNIMPLEMENTED":  # a replica without an adapter registry
                    continue
                raise
            found |= {(a.id, a.version) for a in listed.adapters if a.state == "accepted"}
        return sorted(found)

    async def retrain_adapters(self, decisions: Decisions, d: dict) -> dict:
        adapters = await self._adapters_in_use(d.labels)
        if not adapters:
            raise NothingToDo("no adapter is in use: nothing to retrain")
        await asyncio.to_thread(decisions.add_retrain_requests, d.id, adapters)
        return {"retrain_requests": [{"adapter": a, "version": v} for a, v in adapters]}

    def resample_data(self, decisions: Decisions, d: dict) -> dict:
        out = self.cfg.resample_dir / f"rotation-{d.id}"
        since_ms = now_ms() - int(parse_duration(self.cfg.resample.since) * 1000)
        cfg = replace(self.etl_cfg, seed=self.etl_cfg.seed + d.id)
        manifest = etl.run(decisions.store, out, since_ms, cfg)
        return {"out": str(out), "dataset_version": manifest["dataset_version"], "counts": manifest["counts"],
                "seed": cfg.seed, "since": self.cfg.resample.since}
