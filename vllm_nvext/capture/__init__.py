"""Server-side capture of token-id trajectories, keyed by session (docs/capture.md). Internal."""
