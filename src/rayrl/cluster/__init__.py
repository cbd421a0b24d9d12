"""Cluster layer: resource pools, the fit check, the KV store. Knows nothing of RL."""
