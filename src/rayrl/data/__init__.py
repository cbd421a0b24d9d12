"""rayrl.data."""
