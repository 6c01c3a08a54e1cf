"""Training utilities (activation checkpointing)."""
