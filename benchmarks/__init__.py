"""Reproduction harnesses."""
