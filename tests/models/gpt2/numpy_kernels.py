"""The kernels GPT-2's model.py calls, as NumPy functions with the ops' semantics (outputs written into the given
views; the fixed-point residual stream as int64, kernels/tiles.py), each from the op's float64 reference: with
`cupy` standing for NumPy, the model's own step code (and, tensor-parallel, its shards and all-reduces) runs on the
CPU."""

import numpy as np

from tilekit.kernels.embedding import embedding_reference
from tilekit.kernels.layer_norm import layer_norm_reference
from tilekit.kernels.linear import linear_reference
from tilekit.kernels.tiles import fixed_to_float, float_to_fixed


def _floats(x):
    return fixed_to_float(x) if x.dtype == np.int64 else np.asarray(x, np.float64)


def embedding(ids, wte, wpe=None, positions=None, *, out):
    rows = embedding_reference(ids, wte, wpe, positions)
    out[...] = float_to_fixed(rows) if out.dtype == np.int64 else rows


def layer_norm(x, weight, bias, eps, *, rows=None, out):
    x = _floats(x)
    out[...] = layer_norm_reference(x if rows is None else x[rows], weight, bias, eps)


def linear(x, weight, bias=None, *, activation=None, residual=None, out=None, weight_layout="in_out",
           allow_tf32=False):
    y = linear_reference(x, weight, bias, activation=activation, residual=residual, weight_layout=weight_layout)
    if out is None:
        return y.astype(x.dtype)
    out[...] = y
    return out


def residual_linear(residual, x, weight, bias=None):
    residual += float_to_fixed(linear_reference(x, weight, bias))
    return residual


KERNELS = ("embedding", "layer_norm", "linear", "residual_linear")
