"""tokenloom's version, in a leaf module so any layer (the server's /version) can read it
without importing the package root."""

__version__ = "0.1.0"
