"""Model variants: named weight formats of the served model, preloaded at warm-up; one serves new requests.

"primary" is the format the stage resolved at start (`engine.format`, `auto` included); the others are
`engine.variants` (name -> format). Every format the engine needs (the variants' and the breaker's
fallback) is one model and one runner, keyed by its format, however many names use it. The active
variant is owned by the step loop thread and changed only through its inbox (loop.py), so a switch
happens between two steps: a request takes the variant active when its row is created and keeps it
to the end. Nothing is loaded by a switch.
"""
from __future__ import annotations

from dataclasses import dataclass

# The served format's variant name, which a configured variant may not take (the config schema's
# engine.variants propertyNames pattern is the rule for a configured name).
PRIMARY = "primary"


@dataclass(frozen=True)
class Switch:
    """The outcome of a switch: the variant serving new requests now, and the one before the call."""

    active: str
    previous: str

    @property
    def changed(self) -> bool:
        return self.active != self.previous
