"""Experiment tracking: every complete iteration's figures logged to tensorboard, wandb and
mlflow (``tracking.backends``) by the master, each step once (tracker.py)."""
