"""The package version, in a module of its own: codegen stamps it into generated sources
without importing the runtime (and so PyTorch)."""
__version__ = "0.1.0"
