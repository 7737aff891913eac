"""Which engine replica serves a request: the ingress → engine-core hop's router (no Ray in here).

The policy is Ray Serve LLM's PrefixCacheAffinityRouter's, applied to token ids instead of text (the ingress routes
after tokenizing, so a chat template's rendering is what is matched):

1. Load is the requests in flight on each replica as this ingress replica sees them. When the most and the least
   loaded differ by more than ``imbalanced_threshold``, the least loaded replica takes the request.
2. Otherwise the prompt is matched against a prefix tree of the prompts each replica was sent. If the longest match
   covers at least ``match_rate_threshold`` of the prompt, the least loaded of the replicas holding that match takes it.
3. Else the replica with the smallest tree (the one that holds the least cached text, as far as we know) takes it.

The tree is kept as chained hashes of ``block_tokens``-token blocks: block i's key hashes block i-1's key and block i's
tokens, so a key names a whole path from the root (a radix tree whose edges are blocks), and each key records which
replicas were sent it. Each replica keeps at most ``max_tree_tokens`` tokens: the least recently used blocks go first,
leaves before their parents (a prompt's blocks are touched last-to-first, so its first block is its newest).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from pydantic import Field

from workers.config import Strict


class RouterConfig(Strict):
    policy: Literal["prefix_aware", "least_loaded"] = Field(
        "prefix_aware", description="prefix_aware: Ray Serve LLM's PrefixCacheAffinityRouter policy over token "
        "blocks; least_loaded: the replica with the fewest requests in flight")
    imbalanced_threshold: float = Field(16, ge=0, description="when the in-flight requests of the most and the "
                                        "least loaded replica differ by more than this, the least loaded takes the "
                                        "request whatever its prefix")
    match_rate_threshold: float = Field(0.1, ge=0, le=1, description="the least share of a prompt that must match "
                                        "a replica's tree for its prefix to decide")
    block_tokens: int = Field(16, ge=1, description="tokens per tree block (a prompt's partial last block is not "
                              "kept)")
    max_tree_tokens: int = Field(1 << 20, ge=1, description="most tokens the tree keeps per replica; the least "
                                 "recently sent blocks are forgotten first")


def block_keys(token_ids: list[int], block_tokens: int) -> list[int]:
    """The chained keys of a prompt's whole blocks: key i names blocks 0..i (Python's int and tuple hashes are not
    salted, so every ingress replica computes the same keys)."""
    keys, h = [], 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        h = hash((h, tuple(token_ids[start:start + block_tokens])))
        keys.append(h)
    return keys


class PrefixTree:
    """Multi-replica prefix tree over block keys, with per-replica LRU eviction."""

    def __init__(self, block_tokens: int, max_tokens: int):
        self.block_tokens = block_tokens
        self.max_blocks = max(1, max_tokens // block_tokens)
        self._holders: dict[int, set[str]] = {}  # key -> replicas that were sent that path
        self._lru: dict[str, OrderedDict[int, None]] = {}  # replica -> its keys, least recently sent first

    def add_replica(self, replica: str) -> None:
        self._lru.setdefault(replica, OrderedDict())

    def remove_replica(self, replica: str) -> None:
        for key in self._lru.pop(replica, ()):
            self._drop(key, replica)

    def tokens(self, replica: str) -> int:
        return len(self._lru.get(replica, ())) * self.block_tokens

    def match(self, keys: list[int], replicas) -> tuple[int, set[str]]:
        """(tokens matched, the replicas that hold that longest match) among ``replicas``."""
        alive = set(replicas)
        depth = 0
        for key in keys:
            holders = self._holders.get(key)
            if not holders:
                break
            common = alive & holders
            if not common:
                break
            alive, depth = common, depth + 1
        return depth * self.block_tokens, (alive if depth else set())

    def insert(self, keys: list[int], replica: str) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        for key in reversed(keys):  # the first block ends newest: eviction takes leaves before their parents
            self._holders.setdefault(key, set()).add(replica)
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.max_blocks:
            key, _ = lru.popitem(last=False)
            self._drop(key, replica)

    def _drop(self, key: int, replica: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[key]


class Router:
    """The routing state of one ingress replica for one model: the replicas, their in-flight requests, the tree."""

    def __init__(self, cfg: RouterConfig | None = None):
        self.cfg = cfg or RouterConfig()
        self.tree = PrefixTree(self.cfg.block_tokens, self.cfg.max_tree_tokens)
        self.in_flight: dict[str, int] = {}
        self.routed: dict[str, int] = {}  # requests sent per replica, ever (a tie-break, and /v1/stats)
        self.decisions = {"prefix": 0, "smallest_tree": 0, "imbalanced": 0, "least_loaded": 0}

    @property
    def replicas(self) -> list[str]:
        return list(self.in_flight)

    def add_replica(self, replica: str) -> None:
        if replica not in self.in_flight:
            self.in_flight[replica] = 0
            self.routed.setdefault(replica, 0)
            self.tree.add_replica(replica)

    def remove_replica(self, replica: str) -> None:
        self.in_flight.pop(replica, None)
        self.routed.pop(replica, None)
        self.tree.remove_replica(replica)

    def choose(self, prompt_ids: list[int]) -> str:
        """The replica for a prompt, counted in flight there until ``done``; raises LookupError with no replica."""
        if not self.in_flight:
            raise LookupError("no engine replica")
        load = self.in_flight
        replicas = list(load)
        least = lambda rs: min(rs, key=lambda r: (load[r], self.routed[r], r))  # noqa: E731
        # (one replica: no tree work on the request path; a replica that joins later starts both trees empty)
        keys = (block_keys(prompt_ids, self.cfg.block_tokens)
                if self.cfg.policy == "prefix_aware" and len(replicas) > 1 else [])
        if len(replicas) == 1:
            chosen = replicas[0]
        elif self.cfg.policy == "least_loaded":
            chosen, why = least(replicas), "least_loaded"
        elif max(load.values()) - min(load.values()) > self.cfg.imbalanced_threshold:
            chosen, why = least(replicas), "imbalanced"
        else:
            matched, holders = self.tree.match(keys, replicas)
            if holders and matched >= self.cfg.match_rate_threshold * len(prompt_ids):
                chosen, why = least(holders), "prefix"
            else:
                chosen = min(replicas, key=lambda r: (self.tree.tokens(r), load[r], self.routed[r], r))
                why = "smallest_tree"
        if len(replicas) > 1:
            self.decisions[why] += 1
        if keys:
            self.tree.insert(keys, chosen)
        load[chosen] += 1
        self.routed[chosen] += 1
        return chosen

    def done(self, replica: str) -> None:
        """A request routed to ``replica`` ended (finished, aborted or failed)."""
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1

    def snapshot(self) -> dict:
        return {"policy": self.cfg.policy, "in_flight": dict(self.in_flight), "routed": dict(self.routed),
                "tree_tokens": {r: self.tree.tokens(r) for r in self.in_flight}, "decisions": dict(self.decisions)}
