"""Prefix-cache-aware routing for radixserve.

The Ray-free parts are importable from here (replicas use `CacheDigest` without pulling
in the router). The Serve router itself lives in `router.request_router` (it imports Ray):
`request_router_class: "router.request_router:PrefixAwareRequestRouter"`.
"""
from router.cache_digest import CacheDigest, CacheEventLike, Digest, decode_digest
from router.hashing import block_hashes
from router.policy import Candidate, Choice, Decision, PolicyConfig, choose
from router.prefix_index import PrefixIndex

__all__ = [
    "CacheDigest",
    "CacheEventLike",
    "Candidate",
    "Choice",
    "Decision",
    "Digest",
    "PolicyConfig",
    "PrefixIndex",
    "block_hashes",
    "choose",
    "decode_digest",
]
