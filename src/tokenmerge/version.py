"""The package's version (what a tuned setting file records it was made with)."""

__version__ = "0.1.0"
