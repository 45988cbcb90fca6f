"""Learning: the GSPO loss and the trainer (gradient accumulation over micro-steps,
optimizer steps, checkpoints)."""
