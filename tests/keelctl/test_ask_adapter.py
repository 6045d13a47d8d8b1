"""`keel ask --adapter` against a scripted in-process gateway: the adapter is sent, the serving one
printed, and a refusal printed with its status and reason (exit 1, no traceback)."""
from __future__ import annotations

from keelctl import ask
from keelctl.main import main
from tests.contract.test_client_adapter import gateway  # noqa: F401 - the fixture


def test_ask_sends_the_adapter_and_prints_the_one_that_served(gateway, capsys, monkeypatch):  # noqa: F811
    servicer, target = gateway
    monkeypatch.setattr("keelctl.main._gateway", lambda _layout: target)
    monkeypatch.setattr("keelctl.main.load_layout", lambda: None)
    assert main(["ask", "hi", "--adapter", "pirate"]) == 0
    assert servicer.adapters == ["pirate"] and "adapter pirate@2" in capsys.readouterr().out


def test_a_refused_adapter_is_printed_with_status_and_reason(gateway, capsys):  # noqa: F811
    servicer, target = gateway
    assert ask.main(target, prompt="hi", max_tokens=4, temperature=0.0, seed=None, as_json=False,
                    adapter="drifted") == 1
    assert capsys.readouterr().out.startswith("error: FAILED_PRECONDITION: ADAPTER_REFUSED")
    assert servicer.calls == 1
