"""This folder's tests run kernels through PyTorch: its fixtures, from tests/torch_fixtures.py."""
from torch_fixtures import autograd_path, spec  # noqa: F401 (pytest finds fixtures by their names here)
