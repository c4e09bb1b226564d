"""Tests of the CLI, converter, verify, push and model card (the repack/ folder)."""
