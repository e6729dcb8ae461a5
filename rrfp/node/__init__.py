"""``rrfp node``: the per-node daemon (one per pod) that runs this node's ranks."""
