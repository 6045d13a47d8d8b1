"""Which inference replica a request goes to: by the prompt prefix a replica has cached, unless the
load is imbalanced (SGLang's cache-aware router, in the gateway, which has the prompt's token ids
before it picks a replica).

A prompt is cut into blocks of `block_tokens` tokens and each block keyed by a hash chain (block i's
key covers the adapter and every token of blocks 0..i, as the engine's prefix cache keys its blocks),
so a key names a whole prefix (shared/prefixkeys.py, the engine's own function). `PrefixIndex` remembers,
per replica, the keys of the prompts routed to it (least recently used first out past
`blocks_per_replica`): what that replica has most likely cached, the approximate record. In mode
`precise`, each replica's WatchCache stream (services/gateway/cachewatch.py) reports the keys it does
hold; while that stream is up its report is used instead of the record, when it is down the record
again, and a replica that reports another instance id restarted: its record is forgotten too.
`decide` is the decision itself, a pure function of the candidates, their matched blocks and their
loads; `Router` holds the index and the loads and turns a decision into a route. A replica's load is
the tokens in flight through this gateway (prompt + max_tokens of each request until its answer ends)
or, if more, the running and queued tokens its stream last reported (other gateways' requests too).

    policy           picks
    round_robin      the balancer's rotation (no index, no loads)
    least_loaded     the candidate with the fewest tokens in flight
    prefix_affinity  the candidate with the longest cached prefix, unless imbalanced (reason
                     `imbalanced`: the least loaded) or nothing matches (`miss`: the least loaded)
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared import prefixkeys

POLICIES = ("prefix_affinity", "least_loaded", "round_robin")
MODES = ("precise", "approximate")
REASONS = ("prefix", "imbalanced", "miss", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix_affinity"
    # precise: the index and loads follow each replica's WatchCache stream where it has one;
    # approximate: the index is the gateway's own record of what it routed, loads its own counts.
    mode: str = "precise"
    # Tokens per indexed block (the inference stage's prefill_tokens_per_iteration: its prefix cache's block).
    block_tokens: int = 128
    # Blocks remembered per replica: about what its prefix cache holds (prefix_cache_bytes / block bytes).
    blocks_per_replica: int = 4096
    # Imbalanced when the most and least loaded candidates differ by more than both of these
    # (tokens in flight): then the least loaded gets the request, whatever it has cached.
    imbalance_abs_tokens: int = 4096
    imbalance_ratio: float = 1.5


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str          # one of REASONS
    matched_blocks: int  # blocks of the prompt the chosen replica is believed to hold
    policy: str          # the policy that decided (RoutingConfig.policy)


def block_keys(ids: Sequence[int], block_tokens: int, adapter: str) -> list[bytes]:
    """Keys of the prompt's blocks a prefix cache can serve, as the engine keys them (shared/prefixkeys.py)."""
    return prefixkeys.chain(adapter, ids, block_tokens, prefixkeys.cacheable_blocks(len(ids), block_tokens))


def imbalanced(loads: Sequence[int], cfg: RoutingConfig) -> bool:
    """SGLang's rule: max - min > the absolute threshold and max > ratio * min."""
    hi, lo = max(loads), min(loads)
    return hi - lo > cfg.imbalance_abs_tokens and hi > cfg.imbalance_ratio * lo


def decide(candidates: Sequence[str], matched: dict[str, int], loads: dict[str, int],
           cfg: RoutingConfig) -> Decision:
    """The replica for a request among `candidates` (non-empty, in the balancer's rotation order):
    `matched[r]` blocks of its prompt believed cached on r, `loads[r]` tokens in flight on r.
    Ties go to the least loaded, then to the earlier candidate."""
    least = min(candidates, key=lambda r: loads.get(r, 0))
    if cfg.policy == "round_robin":
        return Decision(candidates[0], "round_robin", matched.get(candidates[0], 0), cfg.policy)
    if cfg.policy == "least_loaded":
        return Decision(least, "least_loaded", matched.get(least, 0), cfg.policy)
    if len(candidates) > 1 and imbalanced([loads.get(r, 0) for r in candidates], cfg):
        return Decision(least, "imbalanced", matched.get(least, 0), cfg.policy)
    best = max(candidates, key=lambda r: (matched.get(r, 0), -loads.get(r, 0)))
    if matched.get(best, 0) == 0:
        return Decision(least, "miss", 0, cfg.policy)
    return Decision(best, "prefix", matched[best], cfg.policy)


class PrefixIndex:
    """Per replica, the block keys believed cached there: its own report while it streams one, else
    the record of what was routed to it (least recently used first out)."""

    def __init__(self, blocks_per_replica: int):
        self.blocks_per_replica = blocks_per_replica
        self._held: dict[str, OrderedDict[bytes, None]] = {}
        self._reported: dict[str, set[bytes]] = {}  # replica -> keys its WatchCache stream says it holds
        self._instance: dict[str, str] = {}         # replica -> the instance id it last reported

    def matched(self, replica: str, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain) the replica holds from the first on."""
        held = self._reported.get(replica, self._held.get(replica))
        n = 0
        if held:
            for k in keys:
                if k not in held:
                    break
                n += 1
        return n

    def record(self, replica: str, keys: Sequence[bytes]) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.blocks_per_replica:
            held.popitem(last=False)

    def reported(self, replica: str, instance: str, keys: Sequence[bytes]) -> None:
        """The replica holds exactly `keys` now; another instance than before restarted since."""
        if self._instance.get(replica, instance) != instance:
            self._held.pop(replica, None)
        self._instance[replica] = instance
        self._reported[replica] = set(keys)

    def changed(self, replica: str, stored: Sequence[bytes], evicted: Sequence[bytes]) -> None:
        held = self._reported.get(replica)
        if held is not None:
            held.difference_update(evicted)
            held.update(stored)

    def unreported(self, replica: str) -> None:
        """Its stream is down: the record stands in for it."""
        self._reported.pop(replica, None)

    def forget(self, replica: str) -> None:
        """Drop the record: the replica is restarting or gone (its cache is empty). Its report, if it
        streams one, stands until the stream says otherwise or ends."""
        self._held.pop(replica, None)


@dataclass
class Route:
    """One request's routing: its keys and cost, then (once picked) its decision."""
    keys: list[bytes]
    tokens: int
    decision: Decision | None = None


class Router:
    """The index and the loads of one gateway's inference replicas; the event loop is its only user."""

    def __init__(self, cfg: RoutingConfig, on_decision: Callable[[Decision], None] = lambda d: None):
        self.cfg = cfg
        self.index = PrefixIndex(cfg.blocks_per_replica)
        self.loads: dict[str, int] = {}     # tokens in flight through this gateway, per replica
        self.reported_loads: dict[str, int] = {}  # running + queued tokens, per replica's stream
        self._on_decision = on_decision

    @property
    def follows_streams(self) -> bool:
        """Whether the gateway should open each replica's WatchCache stream for this router."""
        return self.cfg.mode == "precise" and self.cfg.policy != "round_robin"

    def load(self, replica: str) -> int:
        return max(self.loads.get(replica, 0), self.reported_loads.get(replica, 0))

    def plan(self, ids: Sequence[int], adapter: str, max_tokens: int) -> Route:
        keys = block_keys(ids, self.cfg.block_tokens, adapter) if self.cfg.policy == "prefix_affinity" else []
        return Route(keys, len(ids) + max_tokens)

    def choose(self, route: Route) -> Callable[[Sequence[str]], str]:
        """The balancer's chooser for this route: decides among the candidates it is given."""
        def pick(candidates: Sequence[str]) -> str:
            matched = {r: self.index.matched(r, route.keys) for r in candidates} if route.keys else {}
            route.decision = decide(candidates, matched, {r: self.load(r) for r in candidates}, self.cfg)
            return route.decision.replica
        return pick

    def started(self, replica: str, route: Route) -> None:
        """The request went to `replica`: it will cache the prompt's blocks and carries its tokens."""
        if route.decision is not None:
            self._on_decision(route.decision)
        self.index.record(replica, route.keys)
        self.loads[replica] = self.loads.get(replica, 0) + route.tokens

    def ended(self, replica: str, route: Route) -> None:
        left = self.loads.get(replica, 0) - route.tokens
        if left > 0:
            self.loads[replica] = left
        else:
            self.loads.pop(replica, None)

    def stream_down(self, replica: str) -> None:
        """The replica's WatchCache stream ended: back to this gateway's own record and counts."""
        self.index.unreported(replica)
        self.reported_loads.pop(replica, None)

    def forget(self, replica: str) -> None:
        """The replica is no longer one (its pod left the Service): nothing of it is believed."""
        self.index.forget(replica)
        self.stream_down(replica)
