"""The running base and the adapter registry at the inference stage's start (and for `keel lora`).

The base's fingerprint is computed once per start: the weights hash is the one the stage already
computed for its engine fingerprint (model/digest.py model_sha256, passed in), the tokenizer hashes come from
Keel's own tokenizer file (the tokenizer stage's `vocab_file`), the config values from config.json.
"""
from __future__ import annotations

import logging
from pathlib import Path

from services.inference.lora import fingerprint
from services.inference.lora.checkprompts import load_check_prompts
from services.inference.lora.registry import AdapterTable, Base, LoraConfig, load_registry, versions
from services.inference.lora.startcache import StartCache
from services.inference.model.forward import LlamaRunner
from shared import modelfile, stagestatus
from shared.config import ROOT_DIR
from shared.errors import KeelError

log = logging.getLogger(__name__)


def tokenizer_file(compile: bool = True) -> Path:
    """The compiled vocabulary the tokenizer stage serves: config/tokenizer.yaml's vocab_file, or the
    served model's (compiled now, unless `compile` is False, when the tokenizer stage has not yet)."""
    from services.tokenizer import config as tokenizer_config
    from services.tokenizer.compiler import compile_vocab, compiled_path

    named = tokenizer_config.load().vocab_file
    if named:
        return Path(named) if Path(named).is_absolute() else ROOT_DIR / named
    source = modelfile.source()
    return compile_vocab(source.path, compiled_path(source)) if compile else compiled_path(source)


def running_base(runner: LlamaRunner, model_dir: Path, model_sha: str, format: str, compile: bool = True) -> Base:
    tokenizer = fingerprint.open_tokenizer(tokenizer_file(compile))
    fields = fingerprint.base_fields(model_sha, fingerprint.read_config(model_dir),
                                     fingerprint.tokenizer_hashes(tokenizer), format)
    return Base(runner, fields, load_check_prompts(tokenizer))


def check_adapters(cfg: LoraConfig, runner: LlamaRunner, model_dir: Path, model_sha: str, format: str,
                   engine_key: str = "") -> AdapterTable:
    """Every registered adapter checked against the running base; the accepted ones are in the runner's slots.

    `engine_key`: the engine's warm-start fingerprint key; when given, the check runs' results are
    reused from the LoRA start-up record under var/warm where it verifies (startcache.py), and the
    log line says what was reused. The base needs Keel's tokenizer file; without it an empty registry
    is no problem (nothing to check, logged), but registered adapters stop the start with the
    tokenizer's error."""
    try:  # an empty registry needs no vocabulary compiled for it (a first start on a new model)
        base = running_base(runner, model_dir, model_sha, format, compile=bool(versions(cfg.root)))
    except (KeelError, OSError) as exc:
        if versions(cfg.root):
            raise
        log.warning("no base fingerprint (tokenizer file unusable); the adapter registry is empty",
                    extra={"error": str(exc), "registry": str(cfg.root)})
        return AdapterTable()
    cache = StartCache(engine_key, base) if engine_key else None
    stagestatus.BOARD.phase(f"checking {len(versions(cfg.root))} adapter version(s)")
    table = load_registry(cfg, base, cache)
    log.info("adapters checked", extra={
        "base_fingerprint": table.base_fingerprint, "registry": str(cfg.root),
        "accepted": [s.name for s in table.states if s.state == "accepted"],
        "refused": {s.name: s.reason for s in table.states if s.state == "refused"},
        "start_cache": cache.outcome if cache else "off"})
    return table
