"""luwu_rt: a training runtime for models whose parameters and optimizer state
do not fit in GPU memory. See DESIGN.md for the architecture.

Submodules are imported on use so that importing the package (and ``luwu
--help``) does not pay for torch, numba or the native extension.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
