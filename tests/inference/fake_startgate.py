"""A stand-in for `python -m services.inference.formats.startgate` in background.py's unit tests: it
reads the job, prints three progress lines, then does what FAKE_GATE says: a JSON verdict to print,
"die" (exit 3 without a verdict) or "hang" (wait until killed); "score" stops after the first of the
three lines, as if scoring gate prompts, and waits until killed."""
from __future__ import annotations

import json
import os
import sys
import time

from services.inference.formats.startgate import GateJob

job = GateJob.from_json(sys.stdin.read())
action = os.environ["FAKE_GATE"]
for done in (1, 2, 3):
    print(json.dumps({"done": done, "total": 3}), flush=True)
    if action == "score":
        time.sleep(600)
print("not json: a library printed this", flush=True)
if action == "die":
    sys.exit(3)
if action == "hang":
    time.sleep(600)
verdict = json.loads(action)
assert set(job.formats) == set(verdict.pop("expect_formats")), job.formats
print(json.dumps(verdict), flush=True)
