"""bandit over Keel's code: no medium or high finding (a justified one carries `# nosec <id>` with
its reason on the line above)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BANDIT = Path(sys.executable).with_name("bandit")
SCANNED = [d for d in ("services", "shared", "keelctl", "deploy", "bench", "clients", "training")
           if (ROOT / d).is_dir()]


def _bandit(*targets: str, cwd: Path = ROOT) -> list[dict]:
    out = subprocess.run([str(BANDIT), "-r", *targets, "-ll", "-f", "json", "-q"], cwd=cwd,
                         capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr  # 1: findings
    return json.loads(out.stdout)["results"]


@pytest.mark.slow
def test_no_medium_or_high_findings():
    found = _bandit(*SCANNED)
    assert not found, "\n".join(f"{r['filename']}:{r['line_number']} {r['test_id']} {r['issue_text']}" for r in found)


def test_bandit_catches_a_medium_finding(tmp_path):
    (tmp_path / "bad.py").write_text("import yaml\n\ndef load(text):\n    return yaml.load(text)\n")
    assert [r["test_id"] for r in _bandit("bad.py", cwd=tmp_path)] == ["B506"]
