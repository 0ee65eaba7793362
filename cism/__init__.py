"""cism: a CPU inference engine for language models."""
from cism import _kernels

__version__ = "0.1.0"
