"""buf lint and buf breaking over protos/, with the pinned buf from requirements.lock (buf-bin).

The breaking check compares the working tree's protos with those of the previous main commit (the
merge-base with main on a branch, HEAD~1 on main itself), extracted with `git archive`, so it works
in a git worktree and in a fresh clone where only main exists. The rules: protos/README.md.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = Path(sys.executable).with_name("buf")
PUBLIC = ("keel/gateway/", "keel/common/")
UNSET_OPTION = re.compile(r'File option "\w+" changed from "(false)?" to "')


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def baseline_commit() -> str:
    """The previous main: merge-base of HEAD and main, or HEAD's first parent when HEAD is main."""
    main = next((ref for ref in ("main", "origin/main")
                 if subprocess.run(["git", "rev-parse", "--verify", "-q", ref], cwd=ROOT,
                                   capture_output=True).returncode == 0), None)
    assert main, "no 'main' branch in this clone: the breaking-change check needs it"
    head = _git("rev-parse", "HEAD")
    base = _git("merge-base", "HEAD", main)
    if base != head:
        return base
    parent = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD~1"], cwd=ROOT, capture_output=True, text=True)
    assert parent.returncode == 0, "HEAD is main and has no parent here (a shallow clone?): fetch with depth >= 2"
    return parent.stdout.strip()


def extract_protos(commit: str, dest: Path) -> Path:
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "protos"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    config = dest / "protos" / "buf.yaml"
    if not config.exists():  # an older commit: stop buf from looking for a configuration further up
        config.write_text("version: v2\n")
    return dest / "protos"


def buf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), *args], cwd=ROOT, capture_output=True, text=True)


def forbidden(findings: list[dict], proto_files: set[str]) -> list[dict]:
    """Findings that fail CI: every one in a public file; in an internal file, all but the deletion
    of a file whose package now exists in a higher version (keel/<stage>/vN -> vM, M > N). In any
    file, setting a language option that was unset (or java_multiple_files from its default false)
    is allowed: nothing was generated for that language before."""
    bad = []
    for f in findings:
        deleted = re.search(r'file "([^"]+)" was deleted', f.get("message", ""))
        path = (deleted.group(1) if deleted else f.get("path", "")).removeprefix("protos/")
        if f.get("type", "").startswith("FILE_SAME_") and UNSET_OPTION.match(f.get("message", "")):
            continue
        m = re.match(r"keel/([a-z_]+)/v(\d+)/", path)
        if path.startswith(PUBLIC) or f.get("type") != "FILE_NO_DELETE" or not m:
            bad.append(f)
            continue
        stage, version = m.group(1), int(m.group(2))
        newer = any(re.match(rf"keel/{stage}/v(\d+)/", p) and int(re.match(rf"keel/{stage}/v(\d+)/", p).group(1))
                    > version for p in proto_files)
        if not newer:
            bad.append(f)
    return bad


def breaking(against: Path) -> list[dict]:
    out = buf("breaking", "protos", "--against", str(against), "--error-format", "json")
    assert out.returncode in (0, 100), out.stderr  # 100: findings reported
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def current_files(protos: Path) -> set[str]:
    return {str(p.relative_to(protos)) for p in protos.rglob("*.proto")}


def test_buf_is_the_pinned_version():
    pin = next(line.split("==")[1].split()[0] for line in (ROOT / "requirements.lock").read_text().splitlines()
               if line.startswith("buf-bin=="))
    assert buf("--version").stdout.strip() == pin


def test_buf_lint_has_no_findings():
    out = buf("lint", "protos")
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_forbidden_breaking_change_against_previous_main(tmp_path):
    against = extract_protos(baseline_commit(), tmp_path)
    bad = forbidden(breaking(against), current_files(ROOT / "protos"))
    assert not bad, "breaking changes (see protos/README.md):\n" + "\n".join(f["message"] for f in bad)


def _copy_protos(tmp_path: Path, name: str) -> Path:
    dest = tmp_path / name / "protos"
    for src in (ROOT / "protos").rglob("*"):
        if src.is_file():
            (dest / src.relative_to(ROOT / "protos")).parent.mkdir(parents=True, exist_ok=True)
            (dest / src.relative_to(ROOT / "protos")).write_bytes(src.read_bytes())
    return dest


def _breaking_between(old: Path, new: Path) -> list[dict]:
    out = subprocess.run([str(BUF), "breaking", str(new), "--against", str(old), "--error-format", "json"],
                         capture_output=True, text=True)
    assert out.returncode in (0, 100), out.stderr
    return forbidden([json.loads(x) for x in out.stdout.splitlines() if x.strip()], current_files(new))


def test_a_renamed_public_field_fails(tmp_path):
    old, new = _copy_protos(tmp_path, "old"), _copy_protos(tmp_path, "new")
    gw = new / "keel/gateway/v1/gateway.proto"
    gw.write_text(gw.read_text().replace("string domain = 4;", "string topic = 4;"))
    assert any("domain" in f["message"] for f in _breaking_between(old, new))


def test_an_internal_change_in_place_fails_but_a_version_bump_passes(tmp_path):
    old = _copy_protos(tmp_path, "old")
    in_place = _copy_protos(tmp_path, "in_place")
    tok = in_place / "keel/tokenizer/v1/tokenizer.proto"
    tok.write_text(tok.read_text().replace("bool skip_special_tokens = 2;", "bool keep_special_tokens = 2;"))
    assert _breaking_between(old, in_place)

    bumped = _copy_protos(tmp_path, "bumped")
    v1 = bumped / "keel/tokenizer/v1/tokenizer.proto"
    v2 = bumped / "keel/tokenizer/v2/tokenizer.proto"
    v2.parent.mkdir(parents=True)
    v2.write_text(v1.read_text().replace("keel.tokenizer.v1", "keel.tokenizer.v2")
                  .replace("tokenizer/v1", "tokenizer/v2").replace("Tokenizer.V1", "Tokenizer.V2")
                  .replace("tokenizerv1", "tokenizerv2")
                  .replace("bool skip_special_tokens = 2;", "bool keep_special_tokens = 2;"))
    v1.unlink()
    found = _breaking_between(old, bumped)
    assert found == [], json.dumps(found)


@pytest.mark.parametrize("path", ["keel/gateway/v1/gateway.proto", "keel/common/v1/common.proto"])
def test_deleting_a_public_file_fails_even_with_a_newer_version(tmp_path, path):
    old, new = _copy_protos(tmp_path, "old"), _copy_protos(tmp_path, "new")
    target = new / path
    newer = new / path.replace("/v1/", "/v2/")
    newer.parent.mkdir(parents=True)
    newer.write_text(target.read_text().replace(".v1", ".v2").replace("/v1", "/v2"))
    target.unlink()
    if path.startswith("keel/common/"):  # the gateway imports common: point it at v2
        gw = new / "keel/gateway/v1/gateway.proto"
        gw.write_text(gw.read_text().replace("keel/common/v1/", "keel/common/v2/")
                      .replace("keel.common.v1.", "keel.common.v2."))
    assert _breaking_between(old, new)
