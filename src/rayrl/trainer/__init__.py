"""The driver's side of training: one run lifecycle (`run.Run`) for every trainer
(`contract.Trainer`: `ppo.PPOTrainer`, `sft.SFTTrainer`), step replay, checkpoints and
resume, validation, tracking and the run directory."""
