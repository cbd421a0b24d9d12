"""How `TrainEngine` builds its model: the rank layout (mesh, SP and DP ranks), the model
on the meta device (or loaded whole by transformers where a checkpoint does not map),
sharded with FSDP2, and filled from one read of the checkpoint or from another engine.

`ModelBuilding` is `TrainEngine`'s base: its methods run once, from `__init__` (and
again from `rebuild`), and set the attributes the module docstring of
`rayrl.train.engine` lists (``mesh``, ``sp``, ``dp_rank``, ``load_report``, ...).

After a replacement (``join``) no rank reads the checkpoint together with the others:
a surviving rank fills the rebuilt model from the shards it kept (`rayrl.train.rebuild`,
source ``kept``), a new rank reads only its own shards (``own shards``) and, for a
trainable engine, only when its weights are needed before a restore put them back
(``restore``: a step snapshot or a checkpoint holds every trainable weight). Both run
the same collectives: the mesh, one exchange of whether every rank's kept shards still
fit the new layout (when one does not, every rank reloads from the checkpoint
together, as a start does, and says why), the load report.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rayrl import reads
from rayrl.controller.collective_failure import on_collective_failure
from rayrl.models.safetensors_read import CheckpointIndex, TensorEntry
from rayrl.models.vision_language import vision_tower
from rayrl.train.attention import VARLEN
from rayrl.train.checkpoint_names import as_model_names
from rayrl.train.expert_parallel import num_experts
from rayrl.train.fsdp import attention_modules, ensure_process_group, shard_model
from rayrl.train.load_once import (
    LoadReport,
    checkpoint_tensors,
    copy_weights,
    load_checkpoint,
    load_own_shards,
    materialize,
    node_peak_gb,
    weight_file_bytes,
    weight_plan,
)
from rayrl.train.loading import build_empty_model, load_hf_model
from rayrl.train.logprob_head import install_logprob_head
from rayrl.train.lora import apply_lora, value_head_module
from rayrl.train.mesh import MeshError, MeshSpec, TrainMesh, check_experts, check_heads
from rayrl.train.rank_sync import all_reduce
from rayrl.train.rebuild import Kept
from rayrl.train.ulysses import SPGroup, attach
from rayrl.train.vision_inputs import install_image_splice

__all__ = ["Filler", "ModelBuilding"]

log = logging.getLogger("rayrl.train")

# Fills an empty model's weights on a device; returns (LoadReport.source, bytes read).
Filler = Callable[[torch.nn.Module, torch.device], tuple[str, int]]


class ModelBuilding:
    """The building steps of `rayrl.train.engine.TrainEngine` (module docstring).

    ``join``, ``trainable`` and ``_kept`` (the shards a rebuild kept, else None) are set
    before `_build_model` runs; it sets ``_pending`` for a new rank's deferred read."""

    _kept: Kept | None = None
    freeze_vision_tower = False  # the engine's argument (`TrainEngine`)

    # Set by `TrainEngine.__init__` before the building steps run.
    world_size: int
    sharded: bool
    fsdp: bool
    mixed_precision: bool
    device: torch.device
    model_path: str
    config_overrides: dict[str, Any]
    trainable: bool
    join: bool
    _pending: Callable[[], int] | None  # a new rank's deferred read of its own shards

    if TYPE_CHECKING:

        def _release_groups(self) -> None: ...  # `rayrl.train.recovery.StepRecovery`'s

    def _build_mesh(self, sp: int, fsdp_size: int, ep: int = 1) -> None:
        """The layout of ranks (`rayrl.train.mesh`): sharding mesh, SP, DP and EP ranks."""
        self.mesh_spec = MeshSpec(self.world_size, sp, fsdp_size, ep)
        self.mesh = None
        if self.fsdp:
            ensure_process_group(self.device.type)
            self.mesh = TrainMesh(self.mesh_spec, dist.get_rank(), self.device.type)
        rank = dist.get_rank() if self.mesh is not None else 0
        self.sp_size, self.dp_size = self.mesh_spec.sp, self.mesh_spec.dp
        self.sp_rank, self.dp_rank = self.mesh_spec.sp_rank(rank), self.mesh_spec.dp_rank(rank)
        self.sp = None
        if self.sp_size > 1:
            self.sp = SPGroup(self._wrapped_mesh().sp_group, self.sp_size, self.sp_rank)
        if self.mesh is not None:  # its groups let go of when a peer is lost mid-collective
            on_collective_failure(self._release_groups)

    def _build_model(
        self,
        value_head: bool,
        dtype: str,
        attn: str,
        seed: int,
        trust_remote_code: bool,
        lora: Any,
        gradient_checkpointing: bool,
        weights_from: Any,
    ) -> tuple[torch.nn.Module, Filler | None]:
        """The model, sharded when `fsdp`, and how to fill it: built on the meta device
        with a `Filler` for its weights, or (LoRA, or a checkpoint whose names do not
        map) loaded whole by transformers in this process, with None. A rebuild whose
        kept shards no longer fit the new layout on some rank builds it again, as a
        start does, on every rank."""
        fill: Filler | None = None
        if self._kept is not None:  # a rebuild: the structure only, the kept shards fill it
            model = self._empty_model(value_head, dtype, attn, trust_remote_code)
            fill = self._from_kept
        elif lora is None:
            model = self._empty_model(value_head, dtype, attn, trust_remote_code)
            fill = self._filler(model, value_head, weights_from, seed)
        if fill is None:
            model = load_hf_model(
                self.model_path,
                value_head,
                dtype,
                attn,
                seed,
                trust_remote_code,
                self.config_overrides,
            )
        self.architecture = type(model).__name__
        if self.sp is not None:
            self._check_sequence_parallel(model.config, attn)
        if not value_head:
            install_logprob_head(model)
            install_image_splice(model)  # a vision-language model's images (none: no-op)
        self.lora = lora is not None
        if self.lora:
            model = apply_lora(model, lora, seed)
            if value_head:  # peft froze it; a value head is new, so it trains whole
                value_head_module(model).requires_grad_(True)
        if self.freeze_vision_tower:  # after LoRA, so that the tower's adapters freeze too
            self._freeze_vision_tower(model)
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        if self.mesh_spec.ep > 1:
            check_experts(num_experts(model.config), self.mesh_spec.ep, self.model_path)
        if self.fsdp:
            mesh = self._wrapped_mesh()
            shard_model(
                model, self.device.type, self.mixed_precision, mesh=mesh.fsdp, experts=mesh.experts
            )
        if self.sp is not None:
            attach(model, self.sp, attention_modules(model))
        if self.join and not self._layouts_hold(model):
            self._kept, self.join = None, False  # every rank reloads, as at a start
            return self._build_model(
                value_head,
                dtype,
                attn,
                seed,
                trust_remote_code,
                lora,
                gradient_checkpointing,
                weights_from,
            )
        return model, fill

    def _freeze_vision_tower(self, model: torch.nn.Module) -> None:
        """No gradients for the vision tower, its LoRA adapters included (and so no
        optimizer state for it)."""
        tower = vision_tower(model)
        if tower is None:
            raise ValueError(
                f"freeze_vision_tower=True, but {self.model_path} is a text-only model "
                "(no vision tower); set actor_rollout_ref.actor.freeze_vision_tower=false"
            )
        tower.requires_grad_(False)

    def _empty_model(
        self, value_head: bool, dtype: str, attn: str, trust_remote_code: bool
    ) -> torch.nn.Module:
        return build_empty_model(
            self.model_path,
            value_head,
            dtype,
            attn,
            trust_remote_code,
            self.config_overrides,
        )

    def _layouts_hold(self, model: torch.nn.Module) -> bool:
        """Whether every rank's kept shards fit ``model``'s layout (a new rank's always
        do: it kept none); a collective when sharded. Says why not, on every rank."""
        why = self._kept.layout_change(model) if self._kept is not None else ""
        reasons: list[str | None] = [why]
        if self.sharded:
            reasons = [None] * dist.get_world_size()
            dist.all_gather_object(reasons, why)
        bad = {rank: reason for rank, reason in enumerate(reasons) if reason}
        if not bad:
            return True
        rank, reason = next(iter(bad.items()))
        message = (
            f"{self.model_path}: the rebuilt model is sharded otherwise than before on "
            f"{len(bad)} rank(s) (rank {rank}: {reason}); every rank reloads the weights "
            "from the model directory, as at a start"
        )
        log.warning(message)
        warnings.warn(message, stacklevel=3)
        return False

    def _from_kept(self, target: torch.nn.Module, home: torch.device) -> tuple[str, int]:
        if self._kept is None:
            raise RuntimeError(f"{self.model_path}: no kept shards to fill the rebuilt model")
        self._kept.fill_model(target)
        return "kept", 0

    def _wrapped_mesh(self) -> TrainMesh:
        """``mesh``, which `_build_mesh` makes for an engine wrapped in FSDP2."""
        if self.mesh is None:
            raise RuntimeError(f"{self.model_path}: no device mesh; the engine is not wrapped")
        return self.mesh

    def _check_sequence_parallel(self, config: Any, attn: str) -> None:
        """MeshError unless Ulysses can split this model's heads and attention."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        check_heads(heads, kv_heads, self.sp_size, self.model_path)
        if attn != VARLEN:
            raise MeshError(
                f"ulysses_sequence_parallel_size={self.sp_size} needs rayrl's varlen attention "
                f"(attn_implementation sdpa or eager), not {attn!r}"
            )

    def _filler(
        self,
        model: torch.nn.Module,
        value_head: bool,
        weights_from: Any,
        seed: int,
    ) -> Filler | None:
        """How to fill the empty ``model``: from ``weights_from``'s model, else from one
        read of the checkpoint (``join``: this rank's own shards, `_joining_filler`);
        None (with a warning) when the checkpoint's names or shapes do not map onto the
        model's."""
        if weights_from is not None and not self.join:

            def from_engine(target: torch.nn.Module, home: torch.device) -> tuple[str, int]:
                with weights_from.resident():
                    copy_weights(target, weights_from.model)
                return "engine", 0

            return from_engine
        try:
            index = CheckpointIndex.of(self.model_path)
        except FileNotFoundError as err:
            reason = str(err)
        else:
            wanted = {name for name, _ in checkpoint_tensors(model)}
            index = as_model_names(index, model, wanted)  # a VL checkpoint's saved names
            plan = weight_plan(model, index, value_head)
            if not isinstance(plan, str):
                if self.join:
                    return self._joining_filler(plan, index, seed)

                def from_checkpoint(target: torch.nn.Module, home: torch.device) -> tuple[str, int]:
                    read = load_checkpoint(target, plan, index, home, self.sharded, seed)
                    return "checkpoint", read

                return from_checkpoint
            reason = plan
        warnings.warn(
            f"{self.model_path}: {reason}; every rank loads the whole model with "
            "transformers instead of one read shared by all ranks",
            stacklevel=4,
        )
        return None

    def _joining_filler(
        self, plan: dict[str, TensorEntry | None], index: CheckpointIndex, seed: int
    ) -> Filler:
        """A new rank among ranks that kept their weights: its own shards, read with no
        collective; a trainable engine's only when they are needed before a restore
        (`TrainEngine.restore` or `load`) puts them back (``_pending``)."""

        def own(target: torch.nn.Module, home: torch.device) -> tuple[str, int]:
            return "own shards", load_own_shards(target, plan, index, seed)

        if not self.trainable:
            return own

        def deferred(target: torch.nn.Module, home: torch.device) -> tuple[str, int]:
            self._pending = lambda: own(target, home)[1]
            return "restore", 0

        return deferred

    def _fill(
        self, model: torch.nn.Module, fill: Filler | None, param_offload: bool, start: float
    ) -> None:
        """Allocate and fill an empty ``model`` (``fill``), or place a loaded one; then
        ``bytes_read`` (this rank's reads) and `load_report` (a collective when sharded)."""
        home = self.device if self.fsdp or not param_offload else torch.device("cpu")
        if fill is None:
            source, read = "from_pretrained", weight_file_bytes(self.model_path)
            reads.count(read)
            if not self.fsdp:
                model.to(home)
        else:
            materialize(model, home)
            source, read = fill(model, home)
        self.bytes_read = read
        total = all_reduce([float(read)], self.sharded, self.device)[0]
        seconds = time.perf_counter() - start
        self.load_report = LoadReport(source, int(total), seconds, node_peak_gb(self.sharded))
