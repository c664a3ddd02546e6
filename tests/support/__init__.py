"""What the e2e tests run on: the real servers (`servers`), registered and started here, used by
tests/e2e/conftest.py's fixtures."""
