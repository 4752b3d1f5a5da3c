"""The values a vision-language model's forward reads, kept by the simulation's fake tensors.

A vision-language forward reads values as it runs: it counts the image tokens, splits the tower's
attention by each image's grid, orders its window attention by indices it makes from the grids
(Qwen2.5-VL), keeps the tiles of an image that are real (Idefics3). Fake tensors have no values;
but these are small integer tensors (ids, grids, masks, indices), computed from the batch's
integer tensors and from integer ranges (``arange``). :class:`IntegerValues` gives the integer
tensors that factory functions make their values (PyTorch's fake tensors keep a ``constant`` for
such a tensor, and compute from constants alone on the values:
:func:`memfit.step.seam.values_kept`); the batch's own come with theirs
(:func:`memfit.step.seam.values_tensor`). Each is still allocated, and counted, as a fake tensor: the
values only choose the path, which is the run's.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Factory functions whose integer results keep their values.
_FACTORIES = frozenset(
    {
        aten.arange.default,
        aten.arange.start,
        aten.arange.start_step,
        aten.full.default,
        aten.zeros.default,
        aten.ones.default,
        aten.scalar_tensor.default,
    }
)


#: Comparisons of counts: where the counts were made from pixel values (which no fake tensor holds),
#: the answer is the planned images' (see :class:`IntegerValues`).
_COUNT_TESTS = frozenset({aten.ne.Scalar, aten.eq.Scalar, aten.gt.Scalar, aten.ge.Scalar})
#: The most elements such a test has: one an image (or tile) of a micro-batch.
_COUNT_TEST_ELEMENTS = 1 << 16


class IntegerValues(TorchDispatchMode):
    """Inside a fake tensor mode (entered after it, and after the modes that count memory): integer
    tensors made by factory functions keep their values, up to
    :data:`memfit.step.seam.VALUES_KEPT_ELEMENTS` elements each.

    One test reads the pixels: Idefics3 and SmolVLM keep the images that are not all zeros (the
    processor pads an example's images with blank ones), by counting each image's zero values. A
    planned image is a real one: a count of an integer tensor without values, tested against a
    number, is true for every image (a small tensor, an entry an image)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            func in _COUNT_TESTS
            and out.dtype == torch.bool
            and out.numel() <= _COUNT_TEST_ELEMENTS
            and _fake_without_values(args[0])
            and _integer(args[0].dtype)
        ):
            from torch.utils._mode_utils import no_dispatch

            with no_dispatch():
                out.constant = torch.ones(out.shape, dtype=torch.bool)
            return out
        if func in _FACTORIES and isinstance(out, torch.Tensor) and _integer(out.dtype) and _fake_without_values(out):
            from memfit.step.seam import VALUES_KEPT_ELEMENTS

            if out.numel() <= VALUES_KEPT_ELEMENTS:
                from torch.utils._mode_utils import no_dispatch

                with no_dispatch():
                    out.constant = func(*args, **{**kwargs, "device": "cpu"})
        return out


def _integer(dtype: torch.dtype) -> bool:
    return dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)


def _fake_without_values(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor) and getattr(tensor, "constant", None) is None
