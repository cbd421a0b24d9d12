"""rayrl.engines."""
