"""The policy registry: each policy name to the class that implements it, built per pool.

The names themselves are defined once, in ``gateway.config.PolicyName``: the config validates a
pool's ``policy`` against them (config sits below routing and must not import it), each policy's
``name`` is one of them, and so is its metric label. ``POLICIES`` maps every name to a factory that
takes the pool's config section, so a policy with settings (``kv_aware``'s weights) reads them from
its pool; a test checks that ``POLICIES`` covers ``PolicyName`` exactly. A pool with
``affinity: session`` gets its policy wrapped in ``SessionAffinity``, which compares costs when the
policy has them (``kv_aware``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.config import PolicyName, PoolSettings
from gateway.routing.affinity import SessionAffinity
from gateway.routing.kv_aware import KvAware
from gateway.routing.least_loaded import LeastLoaded
from gateway.routing.round_robin import RoundRobin
from gateway.routing.types import Policy

POLICIES: Mapping[PolicyName, Callable[[PoolSettings], Policy]] = {
    PolicyName.ROUND_ROBIN: lambda pool: RoundRobin(),
    PolicyName.LEAST_LOADED: lambda pool: LeastLoaded(),
    PolicyName.KV_AWARE: lambda pool: KvAware(pool.kv_aware),
}


def make_policy(pool: PoolSettings) -> Policy:
    """A new policy for ``pool`` (never shared: each pool keeps its own rotation state and its
    own sessions)."""
    policy = POLICIES[pool.policy](pool)
    if pool.affinity.by == "session":
        cost = policy.cost if isinstance(policy, KvAware) else None
        return SessionAffinity(policy, pool.affinity, cost)
    return policy
