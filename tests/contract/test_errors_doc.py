"""docs/errors.md lists every reason the code raises, and is what shared/errordoc.py generates."""
from __future__ import annotations

import textwrap
from pathlib import Path

from shared import errordoc, errors

ROOT = Path(__file__).resolve().parents[2]


def test_every_reason_found_in_code_is_catalogued():
    missing = sorted(set(errordoc.scan()) - set(errors.REASONS))
    assert not missing, f"add these to shared/errors.py REASONS: {missing}"


def test_no_catalogued_reason_is_dead():
    unused = sorted(set(errors.REASONS) - set(errordoc.scan()))
    assert not unused, f"no code raises these any more: {unused}"


def test_raise_sites_use_the_catalogued_class():
    wrong = [(reason, s.where, s.cls.__name__) for reason, sites in errordoc.scan().items() for s in sites
             if s.cls and errors.REASONS[reason].cls and not issubclass(s.cls, errors.REASONS[reason].cls)]
    assert not wrong, wrong


def test_the_doc_is_current():
    assert (ROOT / "docs/errors.md").read_text() == errordoc.render(errordoc.scan()), \
        "docs/errors.md is stale: python -m shared.errordoc > docs/errors.md"


def test_every_row_has_domain_status_and_meaning():
    doc = (ROOT / "docs/errors.md").read_text()
    assert f"`domain` is always `{errors.DOMAIN}`" in doc
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip()
            for line in doc.splitlines() if line.startswith("| `")}
    assert rows["RATE_LIMITED"] == "RESOURCE_EXHAUSTED" and rows["MISSING_API_KEY"] == "UNAUTHENTICATED"
    assert "(not catalogued)" not in doc


def _scan_source(tmp_path: Path, source: str) -> dict:
    path = tmp_path / "mod.py"
    path.write_text(textwrap.dedent(source))
    return errordoc.scan_file(path, "services/demo/mod.py")


def test_the_scanner_finds_reasons_in_every_form(tmp_path):
    found = _scan_source(tmp_path, '''
        from shared.errors import InvalidInput, NotReady
        def bad(message, reason, **meta):
            return InvalidInput(message, reason=reason, metadata={"request_id": "r", **meta})
        def check(x, state):
            if x:
                raise InvalidInput("x", reason="BRAND_NEW", metadata={"limit": 3})
            raise bad("y", "VIA_HELPER", index=2)
        def submit(state):
            reason = {"draining": "DRAINING_X"}.get(state, "WARMING_X")
            raise NotReady("z", reason=reason)
        ''')
    assert set(found) == {"BRAND_NEW", "VIA_HELPER", "DRAINING_X", "WARMING_X"}
    assert found["BRAND_NEW"][0].metadata == {"limit"} and found["BRAND_NEW"][0].cls is errors.InvalidInput
    assert found["VIA_HELPER"][0].metadata == {"request_id", "index"}


def test_internal_retry_keys_are_not_documented():
    doc = (ROOT / "docs/errors.md").read_text()
    assert not any(f"`{k}`" in doc for k in errors.INTERNAL_METADATA_KEYS)
