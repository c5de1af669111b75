"""The held-out split: decided by each sample's id alone, so it is the same in every stage and every rerun."""

from __future__ import annotations

import hashlib


def is_held_out(sample_id: str, fraction: float) -> bool:
    """True for about ``fraction`` of ids; stable across processes, machines and dataset orderings."""
    if fraction <= 0:
        return False
    bucket = int.from_bytes(hashlib.sha1(sample_id.encode()).digest()[:4], "big") % 10_000
    return bucket < fraction * 10_000
