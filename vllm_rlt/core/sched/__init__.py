"""Scheduling: plan types, the scheduler, prefill planners and exit policies (no torch)."""
