"""The device mesh of a run and the process groups cut from it.

One DeviceMesh of shape (pp, dp, cp, ep), EP and CP innermost so their frequent
traffic stays inside a node (ARCHITECTURE.md §5). Two flattened 1-D meshes carry FSDP2:
non-expert parameters are sharded over (dp, cp, ep), expert parameters over (dp, cp)
(each EP rank already holds distinct experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mt_parallel.dims import ParallelDims

MESH_AXES = ("pp", "dp", "cp", "ep")


@dataclass
class ParallelMesh:
    """A run's mesh and the coordinates of this process in it.

    Attributes:
        dims: the axis sizes.
        world: the 4-D mesh (pp, dp, cp, ep).
        dense: 1-D mesh over (dp, cp, ep): FSDP of non-expert parameters.
        expert: 1-D mesh over (dp, cp): FSDP of expert parameters.
        batch: 1-D mesh over (dp, ep): the ranks that hold distinct sequences.
    """

    dims: ParallelDims
    world: DeviceMesh
    dense: DeviceMesh
    expert: DeviceMesh
    batch: DeviceMesh

    @property
    def device_type(self) -> str:
        """"cuda" or "cpu"."""
        return self.world.device_type

    def _axis(self, axis: str) -> DeviceMesh:
        flattened = {"dp_cp_ep": self.dense, "dp_cp": self.expert, "dp_ep": self.batch}
        if axis in flattened:  # kept directly: slicing them from the root is deprecated
            return flattened[axis]
        return self.world[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The group of "pp", "dp", "cp", "ep" or a flattened "dp_cp", "dp_ep", "dp_cp_ep"."""
        return self._axis(axis).get_group()

    def rank(self, axis: str) -> int:
        """This process's coordinate along `axis` (any name `group` takes)."""
        return self._axis(axis).get_local_rank()

    @property
    def batch_rank(self) -> int:
        """Index among the dp·ep ranks that read distinct sequences."""
        return self.rank("dp") * self.dims.ep + self.rank("ep")


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """Builds the mesh of an initialized process group.

    Args:
        dims: the layout; its world size must equal the process group's.
        device_type: "cuda" or "cpu".

    Returns:
        The mesh with the flattened FSDP meshes.
    """
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but the layout expects "
            f"{dims.world_size} (pp*dp*cp*ep = {dims.pp}*{dims.dp}*{dims.cp}*{dims.ep}); "
            f"launch {dims.world_size} processes, or build ParallelDims with "
            f"world_size={dist.get_world_size()}"
        )
    world = init_device_mesh(
        device_type, (dims.pp, dims.dp, dims.cp, dims.ep), mesh_dim_names=MESH_AXES
    )
    # DeviceMesh exposes flattening only as _flatten (torch 2.11), the way torchtitan uses it.
    dense = world["dp", "cp", "ep"]._flatten("dp_cp_ep")
    expert = world["dp", "cp"]._flatten("dp_cp")
    batch = world["dp", "ep"]._flatten("dp_ep")
    return ParallelMesh(dims=dims, world=world, dense=dense, expert=expert, batch=batch)
