"""rayrl.config."""
