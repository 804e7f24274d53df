"""End-to-end tests: the real processes started by honcho from the Procfile, the real model."""
