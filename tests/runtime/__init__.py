"""Tests of the runtime part."""
