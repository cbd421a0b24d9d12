"""rayrl.workers."""
