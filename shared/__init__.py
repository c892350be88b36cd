"""Code both sides import: protocol models, the error shape, service classes, settings loading."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kovenlab-edge")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
