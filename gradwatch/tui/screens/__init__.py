"""Modal screens: help, confirm a risky action, pick a run."""
