"""Training entry points' logic (the scripts in launch/ are thin wrappers around these)."""
