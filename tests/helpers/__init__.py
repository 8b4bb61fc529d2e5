"""Test support shared by several test modules: builders of tiny models, corpora, checkpoints and run
configurations, and reference computations. Nothing here is collected as a test; no test module imports
another test module, they import from here (fixtures live in tests/conftest.py)."""
