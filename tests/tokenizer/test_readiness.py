"""Readiness: self_check passes on a good file, and warmup leaves nothing to initialise on a request."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.tokenizer.core import Tokenizer

ROOT = Path(__file__).resolve().parents[2]

FIRST_REQUESTS = r"""
import json, sys
from services.tokenizer.core import EncodeOptions, Tokenizer

tok = Tokenizer.open(sys.argv[1])
tok.self_check()
tok.warmup()
before = set(sys.modules)
rendered = tok.render_chat([("system", "s"), ("user", "first question, 中文 😀 x  1")])
enc = tok.encode(rendered, EncodeOptions(max_length=64, pad_to_max_length=True))
tok.encode("\U00010940 rare path".encode())
text = tok.decode(enc.input_ids, skip_special_tokens=True)
stream = tok.stream_decoder()
streamed = "".join(stream.push(i) for i in enc.input_ids) + stream.finish()
print(json.dumps({"new_modules": sorted(set(sys.modules) - before), "same": text == streamed}))
"""


def test_first_requests_initialise_nothing(compiled_file):
    out = subprocess.run([sys.executable, "-c", FIRST_REQUESTS, str(compiled_file)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"new_modules": [], "same": True}


def test_opening_does_not_import_jinja(compiled_file):
    code = ("import sys; from services.tokenizer.core import Tokenizer; t = Tokenizer.open(sys.argv[1]); "
            "t.self_check(); print('jinja2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(compiled_file)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # ~30 ms of import kept out of open(); warmup() pays it


def test_self_check_and_warmup_can_run_again(compiled_file, ref_ids):
    again = Tokenizer.open(compiled_file)
    for _ in range(2):
        again.self_check()
        again.warmup()
    assert again.encode_ids("ok, 中文 1") == ref_ids("ok, 中文 1")
