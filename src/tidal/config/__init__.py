"""Typed configuration: pydantic schemas per command, TOML loading with overrides, help rendering.

Imports no torch, so `tidal --help` and config validation stay fast.
"""
