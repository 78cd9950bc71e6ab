"""An example tidal environment package: the acronym of a few words (see env.py and docs/environments.md)."""
