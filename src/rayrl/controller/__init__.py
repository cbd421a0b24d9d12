"""rayrl.controller."""
