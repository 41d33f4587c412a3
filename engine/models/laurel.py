"""LAuReL, the learned augmented residual layer (Gemma 3n; arXiv 2411.07501): beside a
layer's attention, its normed input x takes a low-rank path of its own,

    laurel(x) = x + norm(x . L . R)      L (d, r), R (r, d), r << d

which the layer averages with the attention's residual sum ((x + attn + laurel) / sqrt 2,
altup.altup_layer). Its parameters are transformers' Gemma3nTextLaurelBlock: linear_left,
linear_right, post_laurel_norm.
"""

from __future__ import annotations

from flax import nnx

from engine.models.common import Build, make_norm, param
from engine.models.lora import project
from engine.models.specs import LaurelSpec, NormSpec


class Laurel(nnx.Module):
    """x + norm(x . L . R) over the model width, in the compute dtype."""

    def __init__(self, spec: LaurelSpec, norm: NormSpec, build: Build, *, rngs: nnx.Rngs):
        d, r, pdt = build.d_model, spec.rank, build.param_dtype
        self.w_left_dr = param(rngs, (d, r), build.init_std, ("embed", None), pdt)
        self.w_right_rd = param(rngs, (r, d), build.out_std, (None, "embed"), pdt)
        self.norm = make_norm(norm, d, pdt, rngs=rngs)
        self.dtype, self.compute, self.dot_general = build.dtype, build.compute, build.dot_general

    def __call__(self, x_btd):
        kw = {"backward": self.compute.matmul_backward, "dot_general": self.dot_general}
        low_btr = project(self, "w_left_dr", x_btd, 1, self.dtype, **kw)
        return x_btd + self.norm(project(self, "w_right_rd", low_btr, 1, self.dtype, **kw))
