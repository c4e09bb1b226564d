"""Builders and helpers shared by the test modules (no tests here)."""
