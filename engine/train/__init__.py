"""The trainer: one loop with hooks (trainer.py, hooks.py), the pure step (step.py), optimizer,
checkpoints, metrics, and pretraining (`python -m engine.train`)."""
