"""How a group's data travels: integer columns narrowed only where it crosses machines.

The Batch codec (`rayrl.batch_codec`) can send integer tensors in the narrowest type
that holds their values. That saves bytes between nodes and costs a scan and a
widening copy on one host, where the object store is shared memory. The driver (when
it creates a group) and each worker (at its setup) turn it on when the Ray cluster
has more than one live node.
"""

from __future__ import annotations

import ray

from rayrl.batch_codec import narrow_integers


def set_wire_for_cluster() -> bool:
    """Narrow integer columns in this process iff the cluster spans several nodes;
    returns the choice."""
    several = sum(1 for node in ray.nodes() if node.get("Alive")) > 1
    narrow_integers(several)
    return several
