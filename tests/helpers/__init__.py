"""Test support shared by several test modules: builders of tiny models, corpora, checkpoints and run
configurations, and reference computations. Nothing here is collected as a test. Test modules import what
they share from here, not from each other; fixtures they receive as parameters live in tests/conftest.py."""
