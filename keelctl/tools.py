"""Sub-commands that delegate to a stage's own CLI code (same code paths the stages use)."""
from __future__ import annotations

import sys


def dispatch(cmd: str, argv: list[str]) -> int:
    if cmd == "trace":
        from keelctl import trace
        return trace.main(argv)
    if cmd == "tokenize":
        from services.tokenizer import cli
        return cli.tokenize_main(argv, sys.stdin, sys.stdout)
    if cmd == "detokenize":
        from services.tokenizer import cli
        return cli.detokenize_main(argv, sys.stdin, sys.stdout)
    if cmd == "quarantine":
        from keelctl import quarantine
        return quarantine.main(argv)
    if cmd == "replay":
        from keelctl import replay
        return replay.replay_main(argv)
    if cmd == "verify":
        from keelctl import replay
        return replay.verify_main(argv)
    if cmd == "feedback":
        from keelctl import feedback
        return feedback.main(argv)
    if cmd == "rotation":
        from keelctl import rotation
        return rotation.main(argv)
    if cmd == "lora":
        from keelctl import lora
        return lora.main(argv)
    if cmd == "etl":
        from services.feedback import etl
        return etl.main(argv)
    if cmd == "doctor":
        from keelctl import doctor
        return doctor.main(argv)
    if cmd == "variant":
        from keelctl import variant
        return variant.main(argv)
    raise ValueError(cmd)
