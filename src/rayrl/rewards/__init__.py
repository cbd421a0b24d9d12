"""rayrl.rewards."""
