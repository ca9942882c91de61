"""mt-parallel: parallelism applied to mt-models from outside.

`parallelize` turns a meta-device model into a (dp, cp, ep)-parallel one: expert
parallelism (token all-to-all with deduplication and expert-side pre-summing), context
parallelism (zigzag chunks, all-gathered keys/values) and FSDP2 over the two meshes of
ARCHITECTURE.md §5. `run_microbatches` is the schedule when pp == 1; `clip_grad_norm`
clips over both meshes. For pp > 1, `dualpipev_schedule` writes DeepSeek's DualPipeV as
per-rank lists of typed actions and `simulate` checks and times them on CPU;
`split_for_dualpipev` cuts a model into the V's stages, `apply_fsdp_to_stages` shards
them over the dp axis, and `DualPipeVExecutor` runs a rank's list on its two stages
(with FSDP2 reducing gradients once per step, expert and context parallelism inside the
stages; not yet overlapping a ForwardBackward's halves).
"""

from mt_parallel.context_parallel import zigzag_positions, zigzag_ranges
from mt_parallel.dims import ParallelDims
from mt_parallel.dualpipev import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ForwardBackward,
    dualpipev_schedule,
)
from mt_parallel.fsdp import apply_fsdp_to_stages
from mt_parallel.grad_norm import clip_grad_norm
from mt_parallel.mesh import ParallelMesh, build_mesh
from mt_parallel.parallelize import check_batch_split, parallelize, rank_batch_slices
from mt_parallel.pipeline import DualPipeVExecutor
from mt_parallel.pipeline_sim import Simulation, simulate
from mt_parallel.pipeline_stages import PipelineStage, rank_parameters, split_for_dualpipev
from mt_parallel.schedule import MicroBatch, StepResult, run_microbatches

__all__ = [
    "Action",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "DualPipeVExecutor",
    "Forward",
    "ForwardBackward",
    "MicroBatch",
    "ParallelDims",
    "ParallelMesh",
    "PipelineStage",
    "Simulation",
    "StepResult",
    "apply_fsdp_to_stages",
    "build_mesh",
    "check_batch_split",
    "clip_grad_norm",
    "dualpipev_schedule",
    "parallelize",
    "rank_parameters",
    "rank_batch_slices",
    "run_microbatches",
    "simulate",
    "split_for_dualpipev",
    "zigzag_positions",
    "zigzag_ranges",
]
