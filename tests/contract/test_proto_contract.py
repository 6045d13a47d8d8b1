"""The protos' language options follow one scheme derived from the package, in every file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[2] / "protos"
FILES = sorted(PROTOS.rglob("*.proto"))


def expected_options(package: str) -> dict[str, str]:
    parts = package.split(".")  # keel.<name>.v<N>
    name, version = parts[1], parts[2]
    cap = "".join(w.capitalize() for w in name.split("_"))
    return {
        "csharp_namespace": f'"Keel.{cap}.{version.upper()}"',
        "go_package": f'"keel.dev/keel/gen/go/keel/{name}/{version};{name.replace("_", "")}{version}"',
        "java_multiple_files": "true",
        "java_outer_classname": f'"{cap}Proto"',
        "java_package": f'"dev.keel.{name.replace("_", "")}.{version}"',
        "objc_class_prefix": f'"K{name[0].upper()}X"',
        "php_namespace": f'"Keel\\\\{cap}\\\\{version.upper()}"',
        "ruby_package": f'"Keel::{cap}::{version.upper()}"',
    }


def test_every_proto_is_found():
    assert len(FILES) >= 5


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PROTOS)))
def test_language_options_match_the_package(path):
    text = path.read_text()
    package = re.search(r"^package (keel\.\w+\.v\d+);", text, re.M).group(1)
    assert str(path.relative_to(PROTOS).parent) == package.replace(".", "/")
    options = dict(re.findall(r"^option (\w+) = (.+);$", text, re.M))
    assert options == expected_options(package)


def test_public_and_internal_protos_say_so():
    for path in FILES:
        head = path.read_text().split("syntax")[0]
        public = path.relative_to(PROTOS).parts[1] in ("gateway", "common")
        assert ("PUBLIC API" in head) == public and ("INTERNAL API" in head) != public, path
