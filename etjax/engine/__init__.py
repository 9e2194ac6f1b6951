"""The macro level: continuous batching over the paged KV pool, steered by a scheduling policy."""

from etjax.engine.engine import Engine, RequestHandle
from etjax.engine.policies import POLICIES, EntropicPolicy, FcfsPolicy, PriorityPolicy, make_policy

__all__ = [
    "POLICIES",
    "Engine",
    "EntropicPolicy",
    "FcfsPolicy",
    "PriorityPolicy",
    "RequestHandle",
    "make_policy",
]
