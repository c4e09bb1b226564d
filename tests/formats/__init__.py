"""Tests of the formats part."""
