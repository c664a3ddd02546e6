"""Operator capture of token-id trajectories by session (docs/capture.md); internal."""
