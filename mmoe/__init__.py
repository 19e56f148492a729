"""mmoe: multiway Transformers with sparse Mixture-of-Experts FFNs."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mmoe")
except PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
