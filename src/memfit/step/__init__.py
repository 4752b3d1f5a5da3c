"""``memfit.step``: the one training step, and everything that decides its memory.

What is here: the step itself (:mod:`~memfit.step.train_step`), built for a configuration by
:func:`memfit.step.builder.build_step` (the loss it takes, clipping, loss scaling); the losses and
the one function that chooses among them (:mod:`~memfit.step.losses`); preparing a model for a
method (:mod:`~memfit.step.prepare`: 4-bit layers, adapters, checkpointing); the memory-lean
techniques (:mod:`~memfit.step.offload`, :mod:`~memfit.step.tiling`,
:mod:`~memfit.step.lora_inputs`, :mod:`~memfit.step.host_embeddings`); optimizers and the
optimizer step in backward (:mod:`~memfit.step.optim`, :mod:`~memfit.step.step_in_backward`).

The planner runs this code under fake tensors, the trainer on real ones: nothing outside this
package chooses a loss or applies a technique. The step meets its simulation in one module,
:mod:`~memfit.step.seam`: the questions whose answers differ there, the work a simulation may
replay, and the module state that decides memory; no other module of the step knows of fake tensors
or of the planner.

May import: :mod:`memfit.models`, :mod:`memfit.spec`, :mod:`memfit.units`, :mod:`memfit.files`
(and PyTorch, transformers, PEFT, bitsandbytes). Never the planner, watch, train or the CLI.
"""
