"""How a LoRA adapter is named, for every stage that reads a name (the gateway's client contract, the
inference stage's registry).

An id and a version are each 1-64 characters of letters, digits, '.', '_' and '-', the first a letter or
digit: safe in a metric label, a log line and a file name. A client asks for "id" (its newest accepted
version) or "id@version"; which adapters exist, the inference stage alone knows (docs/lora.md).
"""
from __future__ import annotations

import re

PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
ID_OR_VERSION = re.compile(PART)        # use fullmatch
REQUEST = re.compile(f"{PART}(@{PART})?")  # what a request's adapter field may hold; use fullmatch
