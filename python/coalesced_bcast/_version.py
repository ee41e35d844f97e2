"""The package's version, in this one place: pyproject.toml reads it for the distribution's metadata
and the package exports it as coalesced_bcast.__version__."""
__version__ = "0.1.0"
