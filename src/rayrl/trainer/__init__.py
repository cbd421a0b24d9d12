"""The PPO/GRPO loop on the controller: resources, stages, metrics, checkpoints."""
