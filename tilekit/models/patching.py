"""What tilekit.patch and every family's patch rules (<family>/patch.py) share: torch tensors in, tilekit ops
out. Imported only when a model is patched."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is contiguous (all the matrix ops need), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def linear_forward(self, x):
    """nn.Linear's forward on `linear` (weight [out, in])."""
    from tilekit.kernels import linear
    return linear(last_contiguous(x), self.weight, self.bias, weight_layout="out_in")
