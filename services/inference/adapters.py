"""The inference package's surface for tools outside it (`keel lora`, keelctl/lora.py): the adapter
registry's operations and the running base they check adapters against. A tool imports this module
and no module of lora/, model/ or engine/ by name, so those can be re-cut without touching it."""
from __future__ import annotations

from services.inference.config import InferenceConfig
from services.inference.config import load as load_config
from services.inference.lora import manifest
from services.inference.lora.fingerprint import digest
from services.inference.lora.ops import as_json, find, matrix, measure_drift, verify
from services.inference.lora.registration import forward_steps, register
from services.inference.lora.registry import Base, read_running_base, versions

__all__ = ["InferenceConfig", "load_config", "digest", "as_json", "find", "matrix", "measure_drift", "verify",
           "forward_steps", "register", "read_running_base", "versions", "base_format", "running_base", "card"]


def base_format(cfg: InferenceConfig, given: str | None) -> str:
    """The weight format to check adapters in: given, else the one the stage last served (the
    registry's base.json), else engine.format (float32, the reference, for auto)."""
    if given:
        return given
    running = read_running_base(cfg.lora.root)
    if running is not None:
        return running["format"]
    return "float32" if cfg.engine.format == "auto" else cfg.engine.format


def running_base(cfg: InferenceConfig, format: str | None = None) -> Base:
    """The base model of `cfg` loaded in `format` (base_format's default) on the engine's own runner,
    with the stage's thread count, determinism settings and batch-invariant sizes, so the check rows
    meet the kernels a replica runs them on."""
    import sys

    import torch

    from services.inference.engine.warmup import set_deterministic
    from services.inference.lora.startup import running_base as base_of
    from services.inference.model.digest import model_sha256
    from services.inference.model.forward import LlamaRunner
    from services.inference.model.loader import load_model

    e = cfg.engine
    format = base_format(cfg, format)
    print(f"loading the base model ({format}) from {cfg.model_dir}", file=sys.stderr, flush=True)
    if e.intra_op_threads is not None:
        torch.set_num_threads(e.intra_op_threads)
    set_deterministic(e.device)
    runner = LlamaRunner(load_model(cfg.model_dir, format, e.device), e.device)
    if e.batch_invariant:  # the same batch sizes the stage pads to, so check rows meet the same kernels
        runner.calibrate_invariant_sizes(e.max_batch_size)
    return base_of(runner, cfg.model_dir, model_sha256(cfg.model_dir), format)


def card(cfg: InferenceConfig, adapter: str) -> str:
    """The model card of `adapter` ("id@version")."""
    return (find(cfg.lora, adapter) / manifest.CARD).read_text()
