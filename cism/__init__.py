"""cism: a CPU inference engine for language models."""
from cism import _kernels
from cism.paging import OutOfBlocks  # noqa: F401

__version__ = "0.1.0"
