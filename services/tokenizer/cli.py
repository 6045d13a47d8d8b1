"""``keel tokenize`` / ``keel detokenize``: JSON lines in, JSON lines out, in-process.

    keel tokenize   [--compiled FILE]                        < {"text": "..."} lines  -> {"ids": [...]}
    keel detokenize [--compiled FILE] [--skip-special-tokens] < {"ids": [...]} lines   -> {"text": "..."}

Both run the stage's own code (``Tokenizer.encode`` with default options, ``Tokenizer.decode``).
A line that fails becomes ``{"error": {"reason": ..., "message": ...}}`` and the remaining lines are
still processed; the exit status is then 1. Blank lines are skipped. Exit status 2: bad arguments or
an unusable tokenizer file. Without ``--compiled`` the model package's GGUF is compiled (once) to
``var/vocab.kvoc``, the file the stage maps.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from services.tokenizer.core import Tokenizer
from shared.errors import InvalidInput, KeelError


def tokenize_main(argv: list[str], stdin: Iterable, stdout: IO[str]) -> int:
    args = _parse(argv, "keel tokenize", "text -> token ids")
    if isinstance(args, int):
        return args

    def handle(request: dict) -> dict:
        text = request.get("text")
        if not isinstance(text, str):
            raise InvalidInput('each line needs a string field "text"', reason="INVALID_REQUEST")
        return {"ids": tokenizer.encode(text).input_ids}

    tokenizer = _open(args.compiled)
    return 2 if tokenizer is None else _run(stdin, stdout, handle)


def detokenize_main(argv: list[str], stdin: Iterable, stdout: IO[str]) -> int:
    args = _parse(argv, "keel detokenize", "token ids -> text",
                  lambda p: p.add_argument("--skip-special-tokens", action="store_true"))
    if isinstance(args, int):
        return args

    def handle(request: dict) -> dict:
        ids = request.get("ids")
        if not isinstance(ids, list):
            raise InvalidInput('each line needs a list field "ids"', reason="INVALID_REQUEST")
        return {"text": tokenizer.decode(ids, skip_special_tokens=args.skip_special_tokens)}

    tokenizer = _open(args.compiled)
    return 2 if tokenizer is None else _run(stdin, stdout, handle)


def _parse(argv: list[str], prog: str, description: str, extra: Callable | None = None):
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--compiled", type=Path, help="compiled tokenizer file (default: build from the GGUF)")
    if extra is not None:
        # bandit B610 does not apply: an argparse hook named "extra", not Django's QuerySet.extra.
        extra(parser)  # nosec B610
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage
        return int(exc.code or 0)


def _open(compiled: Path | None) -> Tokenizer | None:
    try:
        if compiled is None:
            from services.tokenizer.compiler import compile_vocab, compiled_path
            from shared.modelfile import source
            model = source()
            compiled = compile_vocab(model.path, compiled_path(model))
        tokenizer = Tokenizer.open(compiled)
        tokenizer.self_check()
        return tokenizer
    except (KeelError, FileNotFoundError) as exc:
        print(json.dumps({"error": _error(exc)}), file=sys.stderr)
        return None


def _run(stdin: Iterable, stdout: IO[str], handle: Callable[[dict], dict]) -> int:
    failed = False
    for raw in stdin:
        try:
            line = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        except UnicodeDecodeError as exc:
            reply = {"error": _error(InvalidInput(f"line is not valid UTF-8 at byte {exc.start}",
                                                  reason="INVALID_UTF8"))}
        else:
            if not line.strip():
                continue
            reply = _reply(line, handle)
        failed = failed or "error" in reply
        stdout.write(json.dumps(reply, ensure_ascii=False) + "\n")
        stdout.flush()
    return 1 if failed else 0


def _reply(line: str, handle: Callable[[dict], dict]) -> dict:
    try:
        request = json.loads(line)
    except ValueError as exc:
        return {"error": _error(InvalidInput(f"not JSON: {exc}", reason="INVALID_JSON"))}
    if not isinstance(request, dict):
        return {"error": _error(InvalidInput("each line must be a JSON object", reason="INVALID_REQUEST"))}
    try:
        return handle(request)
    except KeelError as exc:
        return {"error": _error(exc)}


def _error(exc: Exception) -> dict:
    if isinstance(exc, KeelError):
        return {"reason": exc.reason, "message": exc.message}
    return {"reason": "NOT_FOUND", "message": str(exc)}
