"""A run's health: steps that are not finite skipped and rolled back, and alerts on each step's metrics."""
