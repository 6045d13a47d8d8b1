"""The stage prepares a model it has never seen in a child process (server._prepared): the GGUF's
dequantization (torch's parallel work) and transformers' tokenizer conversion stay out of the stage,
whose decode steps ran at half speed for its whole life when the preparation ran in it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared import modelfile
from shared.config import ConfigError
from testing.tinymodels import tiny_model_files

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from services.inference import server
from shared import modelfile
before = "transformers" in sys.modules
out = server._prepared(modelfile.source(sys.argv[1], environ={}))
print(json.dumps({"before": before, "after": "transformers" in sys.modules, "folder": str(out)}))
"""


def test_a_first_start_prepares_the_model_in_a_child_process(tmp_path):
    gguf = tiny_model_files("llama").gguf
    env = dict(os.environ, **{modelfile.MODELS_DIR_ENV: str(tmp_path / "models")})
    done = subprocess.run([sys.executable, "-c", CHILD, str(gguf)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert not got["before"] and not got["after"], "transformers was imported into the stage's process"
    folder = Path(got["folder"])
    assert folder.parent == tmp_path / "models" and (folder / "model.safetensors").is_file()
    assert (folder / "hf-tokenizer" / "tokenizer.json").is_file()


def test_a_model_that_cannot_be_prepared_stops_the_stage_naming_the_field(tmp_path, monkeypatch):
    from services.inference import server

    monkeypatch.setenv(modelfile.MODELS_DIR_ENV, str(tmp_path / "models"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ConfigError, match="field 'model.path' breaks rule 'prepared'"):
        server._prepared(modelfile.source(bad, environ={}))
