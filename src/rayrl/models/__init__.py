"""rayrl.models."""
