"""The ingress → engine router's policy (deployments/routing.py) without Ray: prefix affinity, the match-rate
threshold, the smallest-tree choice for new prefixes, the fall-back to the least loaded replica under imbalance,
replicas coming and going, and the tree's eviction."""

from __future__ import annotations

import random

import pytest

from deployments.routing import PrefixTree, Router, RouterConfig, block_keys

SYSTEM = list(range(1000, 1064))  # a 64-token shared prefix (4 blocks of 16)


def _router(n: int = 2, **cfg) -> Router:
    r = Router(RouterConfig(**cfg))
    for i in range(n):
        r.add_replica(f"r{i}")
    return r


def _question(i: int, length: int = 16) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1, 900) for _ in range(length)]


def test_block_keys_are_chained():
    a = block_keys(SYSTEM + [1, 2, 3], 16)
    assert len(a) == 4  # the partial last block is not kept
    b = block_keys([7] + SYSTEM[1:], 16)
    assert all(x != y for x, y in zip(a, b))  # a different first block changes every later key
    assert block_keys(SYSTEM[:32] + [5] * 32, 16)[:2] == a[:2]


def test_a_shared_prefix_goes_to_one_replica_and_distinct_prefixes_spread():
    r = _router(2)
    shared = {r.choose(SYSTEM + _question(i)) for i in range(6)}
    assert len(shared) == 1
    (home,) = shared
    assert r.decisions["prefix"] == 5  # the first had no match: the smallest tree took it
    other = "r1" if home == "r0" else "r0"
    # a new prefix goes to the replica whose tree is smaller, then its own requests follow it there
    fresh = [_question(100 + i, 64) for i in range(2)]
    assert r.choose(fresh[0]) == other
    assert r.choose(fresh[0] + [1, 2]) == other
    # distinct prompts, one after another (each finished before the next): they alternate by tree size
    r2 = _router(2)
    seen = []
    for i in range(8):
        rep = r2.choose(_question(200 + i, 48))
        r2.done(rep)
        seen.append(rep)
    assert seen.count("r0") == seen.count("r1") == 4


def test_match_rate_threshold():
    r = _router(2, match_rate_threshold=0.5)
    home = r.choose(SYSTEM[:16] + _question(1, 16))
    # 16 of 80 tokens match (20% < 50%): the match does not decide, the smaller tree does
    assert r.choose(SYSTEM[:16] + _question(2, 64)) != home
    # 16 of 24 match (67%): it does
    r3 = _router(2, match_rate_threshold=0.5)
    home = r3.choose(SYSTEM[:16] + _question(1, 16))
    assert r3.choose(SYSTEM[:16] + _question(3, 8)) == home


def test_imbalance_falls_back_to_the_least_loaded():
    r = _router(2, imbalanced_threshold=2)
    got = [r.choose(SYSTEM + _question(i)) for i in range(6)]  # none finishes: all in flight
    home = got[0]
    other = "r1" if home == "r0" else "r0"
    # 3 on home, then home - other = 3 > 2: the fourth goes to the other replica; from then on both hold the prefix
    # and the least loaded of the holders takes each
    assert got[:3] == [home] * 3 and got[3] == other
    assert r.decisions["imbalanced"] == 1
    assert abs(r.in_flight["r0"] - r.in_flight["r1"]) <= 2
    for rep in got:
        r.done(rep)
    assert r.in_flight == {"r0": 0, "r1": 0}


def test_least_loaded_policy_ignores_prefixes():
    r = _router(3, policy="least_loaded")
    got = [r.choose(SYSTEM) for _ in range(6)]
    assert sorted(got) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert r.tree.tokens("r0") == 0


def test_replicas_come_and_go():
    r = _router(3)
    home = r.choose(SYSTEM)
    r.remove_replica(home)
    second = r.choose(SYSTEM)
    assert second != home and home not in r.snapshot()["routed"]
    r.done(second)
    r.add_replica(home)  # a replacement starts with an empty tree: the prefix stays where it is now
    assert r.choose(SYSTEM) == second
    for rep in list(r.replicas):
        r.remove_replica(rep)
    with pytest.raises(LookupError):
        r.choose(SYSTEM)
    # one replica: no tree is kept (nothing to choose between)
    r.add_replica("only")
    assert r.choose(SYSTEM) == "only" and r.tree.tokens("only") == 0


def test_tree_eviction_is_lru_and_leaves_first():
    tree = PrefixTree(block_tokens=4, max_tokens=16)  # 4 blocks per replica
    tree.add_replica("a")
    old, new = block_keys(list(range(12)), 4), block_keys(list(range(100, 108)), 4)
    tree.insert(old, "a")
    tree.insert(new, "a")  # 5 blocks: one of the old prompt's goes, its deepest
    assert tree.tokens("a") == 16
    assert tree.match(old, ["a"]) == (8, {"a"})
    assert tree.match(new, ["a"]) == (8, {"a"})
    tree.insert(old, "a")  # touched again: the new prompt's leaf goes first now
    assert tree.match(old, ["a"])[0] == 12 and tree.match(new, ["a"])[0] == 4
    tree.remove_replica("a")
    assert tree.match(old, ["a"]) == (0, set()) and not tree._holders


def test_the_dp2_config_parses():
    """configs/cpu-tiny-dp2.yaml: two engine replicas behind the prefix-aware router, accepted by our config."""
    from pathlib import Path

    import yaml

    from deployments.config import LLMConfig

    text = (Path(__file__).resolve().parents[2] / "configs" / "cpu-tiny-dp2.yaml").read_text()
    (app,) = yaml.safe_load(text)["applications"]
    cfg = LLMConfig(**app["args"])
    assert cfg.deployment_config == {"num_replicas": 2}
    assert (cfg.request_router.policy, cfg.request_router.imbalanced_threshold) == ("prefix_aware", 8)
    for bad, match in [({"num_replicas": 0}, "num_replicas"), ({"num_replicas": "auto"}, "num_replicas"),
                       ({"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}, "min_replicas"),
                       ({"num_replicas": 2, "autoscaling_config": {"min_replicas": 1}}, "not both")]:
        with pytest.raises(ValueError, match=match):
            LLMConfig(**dict(app["args"], deployment_config=bad))
