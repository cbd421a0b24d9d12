"""rayrl.algos."""
