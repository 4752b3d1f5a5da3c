"""LoRA on 4-bit experts, in PEFT's layout: the adapter a 16-bit model loads.

PEFT adapts a fused expert weight with its ``ParamWrapper``: per expert a LoRA pair (``lora_A``
``[r x experts, in]``, ``lora_B`` ``[out, r x experts]``), whose update it folds into the weight at
each forward. A 4-bit experts module (:mod:`memfit.models.experts_nf4`) has no 16-bit weight to
fold into: :class:`ParamWrapper` here is PEFT's wrapper with the same parameters, names and
nesting (two weights of one module: one wrapper around the other), whose forward hands the pair to
the experts module, which adds ``x A_e^T B_e^T`` to each expert's rows. The saved adapter is PEFT's,
and PEFT loads it on the 16-bit model as its own.

PEFT builds these wrappers through its custom-module hook (:func:`register`); it tells a parameter
wrapper from other adapter layers by its class name when it nests them, so the class keeps the
name ``ParamWrapper``.
"""

from __future__ import annotations

from typing import Any

from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper

from memfit.models.experts_nf4 import NF4Experts


class ParamWrapper(PeftParamWrapper):
    """PEFT's LoRA wrapper of one fused expert weight, for a 4-bit experts module."""

    def _get_in_out_features(self, module):
        # What PEFT reads from the 16-bit parameter's shape ([experts, out, in], or [experts, in, out]
        # transposed): its second and third sizes. Here the parameter is packed, so the module says
        # what it stands for; PEFT then swaps them as for the 16-bit weight.
        weight = next(w for w in self.get_base_layer().expert_weights if w.name == self.parameter_name)
        self.num_experts = weight.num_experts
        self._param_ndim = 3
        return (
            (weight.in_features, weight.out_features)
            if weight.transposed
            else (weight.out_features, weight.in_features)
        )

    def forward(self, x, *args: Any, **kwargs: Any):
        self._check_forward_args(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        active = [name for name in self.active_adapters if name in self.lora_A]
        if self.disable_adapters or not active:
            return self.base_layer(x, *args, **kwargs)
        if len(active) > 1:
            raise ValueError("LoRA on 4-bit experts runs one adapter at a time")
        experts = self.get_base_layer()
        name = active[0]
        experts.lora_factors[self.parameter_name] = (
            self.lora_A[name].weight,
            self.lora_B[name].weight,
            self.scaling[name],
            self._did_swap_in_out_features,
        )
        try:
            return self.base_layer(x, *args, **kwargs)
        finally:
            experts.lora_factors.pop(self.parameter_name, None)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise ValueError(
            "a LoRA adapter on 4-bit experts is merged into the 16-bit weights: memfit merge --base <model> --adapter <run>"
        )


def register(config) -> None:
    """Have PEFT build :class:`ParamWrapper` for the weights of 4-bit experts (``config``: a LoraConfig)."""
    config._register_custom_module({NF4Experts: ParamWrapper})
