"""Two worker processes map one compiled file: its pages are shared, and each worker grows little."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WORKER = r"""
import json, re, sys
import psutil
from services.tokenizer.core import Tokenizer

path = sys.argv[1]
me = psutil.Process()
before = me.memory_full_info().uss
tok = Tokenizer.open(path)
tok.self_check()  # reads every page of the file (checksum)
tok.warmup()
after = me.memory_full_info().uss
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()  # wait until the other worker is up too, then look at the mapping
mapping, entry = {}, None
with open("/proc/self/smaps") as smaps:
    for line in smaps:
        fields = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):  # a mapping's header line
            entry = {} if fields[-1] == path else None
            if entry is not None:
                mapping = entry
        elif entry is not None and len(fields) == 3 and fields[2] == "kB":
            entry[fields[0][:-1]] = int(fields[1])
print(json.dumps({"uss_growth": after - before, "mapping_kb": mapping}), flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_two_workers_share_the_mapped_tables(compiled_file):
    pytest.importorskip("psutil")
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(compiled_file)], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for w in workers:
            assert json.loads(w.stdout.readline()) == {"ready": True}
        reports = []
        for w in workers:  # both are alive and have touched every page
            w.stdin.write("go\n")
            w.stdin.flush()
            reports.append(json.loads(w.stdout.readline()))
    finally:
        for w in workers:
            w.kill()
            w.wait()
    file_kb = compiled_file.stat().st_size // 1024
    for report in reports:
        mapping = report["mapping_kb"]
        assert mapping, "the compiled file is not mapped"
        assert mapping["Private_Dirty"] == 0  # nothing was copied into the process
        assert mapping["Shared_Clean"] >= file_kb * 0.9  # resident pages are the page cache's, shared
        assert report["uss_growth"] < 20 * 1024 * 1024, report
