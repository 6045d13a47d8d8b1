"""What `keel` prints when things go wrong around it: a reader that goes away (`keel ... | head`) ends
it quietly, and an error line says a code once."""
from __future__ import annotations

import subprocess
import sys

from keelctl import ask
from testing.mesh import ROOT
from testing.ports import free_port


def test_a_reader_that_goes_away_ends_keel_without_a_traceback():
    """A command whose output outlasts its reader (as `keel status | head` with many processes)."""
    long_output = ("import sys, keelctl.main as m\n"
                   "m._main = lambda argv: [print('process line ' * 8) for _ in range(20000)] and 0\n"
                   "sys.exit(m.main([]))")
    proc = subprocess.Popen([sys.executable, "-c", long_output], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # as `head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_an_error_says_its_code_once(capsys):
    target = f"127.0.0.1:{free_port()}"  # nothing listens: UNAVAILABLE, whose reason is the code itself
    assert ask.main(target, prompt="hi", max_tokens=4, temperature=0.0, seed=None, as_json=False,
                    timeout_s=2.0) == 1
    out = capsys.readouterr().out
    assert out.startswith("error: UNAVAILABLE: ") and "UNAVAILABLE: UNAVAILABLE" not in out
