"""The names of memory categories, used everywhere (no imports: cheap for the CLI)."""

#: What the tracker attributes live tensor bytes to.
TRACKED_CATEGORIES = ("weights", "trainable", "gradients", "optimizer", "activations", "temporaries", "runtime")

#: Categories of a plan's device total, in the order they are shown; they sum to the device total.
#: ``allocator`` (reserved minus allocated) is added by the planner; ``runtime`` also holds the CUDA
#: context, which lies outside the allocator.
CATEGORIES = ("weights", "trainable", "gradients", "optimizer", "activations", "temporaries", "allocator", "runtime")
