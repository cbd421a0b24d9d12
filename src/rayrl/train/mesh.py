"""The training engine's device meshes on the process group the worker group formed.

`TrainMesh` builds, from a `rayrl.config.layout.MeshSpec` (how the world splits into
sharding groups and sequence-parallel groups), the device mesh FSDP2 shards over (1-D,
or 2-D ``[replicate, shard]`` for hybrid sharding) and this rank's Ulysses
sequence-parallel process group, and with expert parallelism the 2-D ``[edp, ep]`` mesh
whose rows hold the experts between them (`rayrl.train.expert_parallel`).
`init_device_mesh` makes the sub-groups over the
existing default process group: roles never form their own world.
"""

from __future__ import annotations

from typing import Any

from rayrl.config.layout import MeshError, MeshSpec, check_experts, check_heads

__all__ = ["MeshError", "MeshSpec", "TrainMesh", "check_experts", "check_heads"]


class TrainMesh:
    """The device meshes of one engine on the current default process group.

    ``fsdp``: the mesh FSDP2 shards over (1-D ``[shard]`` or 2-D ``[replicate, shard]``);
    ``sp_group``: this rank's sequence-parallel process group (None without SP);
    ``experts``: the ``(ep, edp)`` meshes of expert parallelism (None without it). Building
    it is a collective: every rank of the group builds the same `MeshSpec`.
    """

    def __init__(self, spec: MeshSpec, rank: int, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.spec, self.rank = spec, rank
        if spec.hybrid:
            self.fsdp: Any = init_device_mesh(
                device_type,
                (spec.replicate, spec.shard),
                mesh_dim_names=("dp_replicate", "dp_shard"),
            )
        else:
            self.fsdp = init_device_mesh(device_type, (spec.world,), mesh_dim_names=("dp_shard",))
        self.experts: tuple[Any, Any] | None = None  # (ep, edp) meshes
        if spec.ep > 1:
            grid = init_device_mesh(device_type, (spec.edp, spec.ep), mesh_dim_names=("edp", "ep"))
            self.experts = (grid["ep"], grid["edp"])
        self.sp_group = None
        if spec.sp > 1:
            data = init_device_mesh(device_type, (spec.dp, spec.sp), mesh_dim_names=("dp", "sp"))
            self.sp_group = data["sp"].get_group()

    @property
    def dp_rank(self) -> int:
        return self.spec.dp_rank(self.rank)

    @property
    def sp_rank(self) -> int:
        return self.spec.sp_rank(self.rank)
