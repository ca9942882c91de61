"""mt-parallel: parallelism applied to mt-models from outside.

`parallelize` turns a meta-device model into a (dp, cp, ep)-parallel one: expert
parallelism (token all-to-all with deduplication and expert-side pre-summing), context
parallelism (zigzag chunks, all-gathered keys/values) and FSDP2 over the two meshes of
ARCHITECTURE.md §5. `run_microbatches` is the schedule when pp == 1; `clip_grad_norm`
clips over both meshes. The DualPipeV pipeline schedule comes next.
"""

from mt_parallel.context_parallel import zigzag_positions, zigzag_ranges
from mt_parallel.dims import ParallelDims
from mt_parallel.grad_norm import clip_grad_norm
from mt_parallel.mesh import ParallelMesh, build_mesh
from mt_parallel.parallelize import check_batch_split, parallelize, rank_batch_slices
from mt_parallel.schedule import MicroBatch, StepResult, run_microbatches

__all__ = [
    "MicroBatch",
    "ParallelDims",
    "ParallelMesh",
    "StepResult",
    "build_mesh",
    "check_batch_split",
    "clip_grad_norm",
    "parallelize",
    "rank_batch_slices",
    "run_microbatches",
    "zigzag_positions",
    "zigzag_ranges",
]
