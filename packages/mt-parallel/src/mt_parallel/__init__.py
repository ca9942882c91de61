"""mt-parallel: parallelism applied to mt-models from outside.

The walking skeleton holds the layout description (`ParallelDims`) and the plain
micro-batch schedule used when pp == 1. FSDP2, expert, context and pipeline (DualPipeV)
parallelism build on these.
"""

from mt_parallel.dims import ParallelDims
from mt_parallel.schedule import MicroBatch, StepResult, run_microbatches

__all__ = ["MicroBatch", "ParallelDims", "StepResult", "run_microbatches"]
