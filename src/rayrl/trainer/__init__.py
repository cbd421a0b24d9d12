"""rayrl.trainer."""
