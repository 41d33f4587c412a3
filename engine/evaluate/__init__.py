"""Evaluation of checkpoints: held-out loss, generation accuracy and pass@k, the report."""
