"""Training: the loop, checkpoints, and metrics (one record per logged step to console, JSON lines, wandb)."""
