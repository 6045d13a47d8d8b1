"""Plugin loading by dotted path, protocol checks, and a custom plugin from this module."""
from __future__ import annotations

import pytest

from services.validator import builtins
from services.validator.output_pipeline import OutputPipeline, PipelineConfig
from services.validator.plugins import (
    OutputContext,
    OutputValidator,
    PluginSpec,
    TextProcessor,
    Verdict,
    build_plugin,
    import_object,
)


class ShoutingValidator:
    """A custom validator living in a test module: fails on text that is all upper case."""

    instances = 0

    def __init__(self, min_letters: int = 3):
        type(self).instances += 1
        self.min_letters = min_letters

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        letters = [c for c in output if c.isalpha()]
        if len(letters) >= self.min_letters and all(c.isupper() for c in letters):
            return Verdict(f"shouting in domain {context.domain}")
        return None


class Reverser:
    def process(self, text: str) -> str:
        return text[::-1]


class NotAPlugin:
    def check(self, text):
        return True


def path_of(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def test_import_object_accepts_both_spellings():
    assert import_object("services.validator.builtins:EmptyOutput") is builtins.EmptyOutput
    assert import_object("services.validator.builtins.EmptyOutput") is builtins.EmptyOutput


@pytest.mark.parametrize("path", ["nope", "services.validator.builtins:Missing",
                                  "no.such.module:X", ":X"])
def test_bad_paths_fail_with_value_error(path):
    with pytest.raises(ValueError, match="plugin path"):
        import_object(path)


def test_build_plugin_checks_protocols_and_args():
    v = build_plugin(PluginSpec("shout", path_of(ShoutingValidator), {"min_letters": 2}))
    assert isinstance(v, OutputValidator) and v.min_letters == 2
    assert isinstance(build_plugin(PluginSpec("rev", path_of(Reverser))), TextProcessor)
    with pytest.raises(ValueError, match="neither"):
        build_plugin(PluginSpec("x", path_of(NotAPlugin)))
    with pytest.raises(ValueError, match="bad args"):
        build_plugin(PluginSpec("x", path_of(ShoutingValidator), {"colour": 1}))
    with pytest.raises(ValueError, match="min_count"):
        build_plugin(PluginSpec("x", "services.validator.builtins:RequiredTerms",
                                {"terms": ["LPR"], "min_count": 2}))


def config(validators, processors=(), plugins=None, on_fail="annotate"):
    plugins = plugins or {"shout": {"path": path_of(ShoutingValidator), "on_fail": on_fail},
                          "rev": {"path": path_of(Reverser)},
                          "empty": {"path": "services.validator.builtins:EmptyOutput"}}
    return PipelineConfig.from_dict({"plugins": plugins, "domains": {
        "default": {"validators": list(validators), "processors": list(processors)},
        "loud": {"validators": ["shout"]}}})


def test_custom_plugin_from_config_is_built_once_and_chosen_by_domain():
    before = ShoutingValidator.instances
    pipe = OutputPipeline.from_config(config(["empty"]))
    assert ShoutingValidator.instances == before + 1      # once at startup, shared by domains
    assert pipe.run("HELLO THERE", OutputContext(domain="default")).verdicts == []
    result = pipe.run("HELLO THERE", OutputContext(domain="loud"))
    assert [(v.plugin, v.message, v.blocking) for v in result.verdicts] == [
        ("shout", "shouting in domain loud", False)]
    assert not result.blocked
    for _ in range(3):
        pipe.run("x", OutputContext(domain="loud"))
    assert ShoutingValidator.instances == before + 1


def test_on_fail_block_blocks():
    pipe = OutputPipeline.from_config(config(["shout"], on_fail="block"))
    result = pipe.run("STOP", OutputContext())
    assert result.blocked and result.verdicts[0].blocking and result.flags == ["blocked"]


def test_processor_runs_before_validators():
    pipe = OutputPipeline.from_config(config(["shout"], processors=["rev"]))
    assert pipe.run("abc", OutputContext()).text == "cba"


@pytest.mark.parametrize("domains, message", [
    ({"default": {"validators": ["ghost"]}}, "unknown plugin"),
    ({"default": {"validators": ["rev"]}}, "not an OutputValidator"),
    ({"default": {"processors": ["shout"]}}, "not a TextProcessor"),
    ({"loud": {}}, "'default' domain is required"),
])
def test_miswired_config_fails_at_startup(domains, message):
    plugins = {"shout": {"path": path_of(ShoutingValidator)}, "rev": {"path": path_of(Reverser)}}
    with pytest.raises(ValueError, match=message):
        OutputPipeline.from_config(PipelineConfig.from_dict({"plugins": plugins,
                                                             "domains": domains}))


@pytest.mark.parametrize("spec, message", [
    ({}, "path"), ({"path": "a:b", "on_fail": "explode"}, "on_fail"),
    ({"path": "a:b", "args": [1]}, "args must be a mapping"), ({"path": "a:b", "x": 1}, "unknown"),
])
def test_bad_plugin_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        PluginSpec.from_dict("p", spec)
