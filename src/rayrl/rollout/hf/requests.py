"""The HF engine's request-level core: samples in one growing KV cache of an HF model.

`HFRequests` serves the request contract (`rayrl.rollout.requests`) on a
transformers decoder that takes ``past_key_values`` and ``position_ids`` (the models
`decode.can_lean_decode` accepts, without sliding-window layers). Every live sample
owns one row of a `DynamicCache`; each step is one forward over every row:

- a **prefill** feeds each sample that has tokens the cache lacks (a new prompt, or a
  resumed turn: its last sampled token and the appended answer) those tokens,
  left-padded to the longest, and draws its next token from the last position;
- a **decode** feeds each running sample its last sampled token.

A row with nothing to feed in a step (a parked sample, a running one during a
prefill, a finished one not yet dropped) is fed the pad id under a 0 in the attention
mask: a *hole* its later tokens never attend to. Positions are each sample's own
(counted over its real tokens), so holes change nothing it computes. A prefill
stalls the running samples, so while some decode, new and resumed samples wait until
the decode steps they lost, summed, reach ``resume_cost`` times the running samples
(or ``resume_max_wait`` steps), as the native scheduler's; with none running they
are prefilled at once. When no sample runs, rows of finished samples and columns no
live row uses are dropped from the cache; an empty engine drops the cache.

A vision-language model's sample may come with images (its prompt's pixel inputs at
`add`, an observation's at `resume`, `rayrl.rollout.turns.TurnImages`): the prefill
that feeds their placeholder tokens embeds the ids, runs the vision tower on those
images and puts their features at the placeholders (the prompt's image tokens and the
observations' placeholder columns, never a sampled image token). Its positions are the
model's M-RoPE ones (``get_rope_index`` over the whole sequence so far, the piece fed
cut from them); a text token after them sits at the last position + 1 on all three
axes, so each sample keeps the position of its next token (``pos``; for a text sample,
its count of tokens).

A token is drawn with the seeded sampler at its column in the response (appended
tokens count), so this draws the tokens the native engine draws and a sample replays
alone, in any batch. Each token carries the policy `version` the engine held when it
drew it; weights may change between steps (the samples keep their caches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from rayrl import progress
from rayrl.models.vision_language import multimodal_core, splice_image_features, stack_images
from rayrl.rollout.native.stops import StopStrings
from rayrl.rollout.requests import DONE, TURN, SampleOutput
from rayrl.rollout.sampling import SamplingParams, sample_tokens
from rayrl.rollout.turns import TurnImages

__all__ = ["HFRequests", "can_serve_requests"]

WHERE = "HFRolloutEngine"
RESUME_PREFILL_COST = 4.0  # a prefill step's cost in decode steps (eager forwards)
RESUME_MAX_WAIT = 16


def can_serve_requests(model: nn.Module) -> bool:
    """True when `HFRequests` computes for ``model`` what a plain forward computes: a
    decoder whose every cache layer is a full-attention `DynamicLayer` (holes in a
    sliding window would shift what it keeps)."""
    from transformers import DynamicCache

    from rayrl.rollout.hf.decode import can_lean_decode

    if not can_lean_decode(model):
        return False
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    return all(not getattr(layer, "is_sliding", False) for layer in cache.layers)


class _Samples:
    """Per-sample state in numpy arrays, grown as requests need."""

    # The arrays of FIELDS and the per-token ones, set by `grow` (declared for type checkers).
    max_new: np.ndarray
    keys: np.ndarray
    gen: np.ndarray
    ctx: np.ndarray
    pos: np.ndarray
    row: np.ndarray
    turn_start: np.ndarray
    order: np.ndarray
    stopped: np.ndarray
    finished: np.ndarray
    running: np.ndarray
    parked: np.ndarray
    waiting: np.ndarray
    parks: np.ndarray
    aborted: np.ndarray
    tokens: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray

    FIELDS = {
        "max_new": np.int64,
        "keys": np.int64,
        "gen": np.int64,  # response tokens so far (sampled and appended)
        "ctx": np.int64,  # tokens of its sequence (prompt + response) the cache holds
        "pos": np.int64,  # the position of its next token (M-RoPE: past its images)
        "row": np.int64,  # cache row (-1: none)
        "turn_start": np.int64,
        "order": np.int64,  # when it was added: new cache rows follow this order
        "stopped": bool,
        "finished": bool,
        "running": bool,  # has a drawn token to feed next
        "parked": bool,
        "waiting": bool,  # has tokens to prefill (a new prompt or a resumed turn)
        "parks": bool,
        "aborted": bool,
    }

    def __init__(self) -> None:
        self.capacity = self.width = 0
        self.prompt_of: list[np.ndarray | None] = []
        self.media_of: list[list[dict]] = []  # each sample's images, in order
        self.pending_of: list[list[dict]] = []  # those the cache has not seen yet
        self.marks_of: list[list[int]] = []  # response columns of observation images
        self.free: list[int] = []
        self.grow(16, 16)

    def grow(self, capacity: int, width: int) -> None:
        old_cap, old_width = self.capacity, self.width
        for name, dtype in self.FIELDS.items():
            array = np.zeros(capacity, dtype=dtype)
            if old_cap:
                array[:old_cap] = getattr(self, name)
            setattr(self, name, array)
        self.row[old_cap:] = -1
        for name, dtype in (
            ("tokens", np.int64),
            ("log_probs", np.float32),
            ("versions", np.int64),
        ):
            array = np.zeros((capacity, width), dtype=dtype)
            if old_cap:
                array[:old_cap, :old_width] = getattr(self, name)
            setattr(self, name, array)
        self.prompt_of.extend([None] * (capacity - old_cap))
        for media in (self.media_of, self.pending_of, self.marks_of):
            media.extend([] for _ in range(capacity - old_cap))
        self.free = list(range(capacity - 1, old_cap - 1, -1)) + self.free
        self.capacity, self.width = capacity, width

    def take(self, count: int, width: int) -> np.ndarray:
        while len(self.free) < count:
            self.grow(2 * self.capacity, self.width)
        if width > self.width:
            self.grow(self.capacity, width)
        return np.array([self.free.pop() for _ in range(count)], dtype=np.int64)


class HFRequests:
    """Requests on an HF model (module docstring).

    Args:
        model: the decoder (used as is: a hybrid engine's training module works).
        pad_id: the id fed in holes.
        eos_ids: ids that end a turn (unless the sampling ignores EOS).
        tokenizer: for stop strings.
        forward_mode: a context manager factory the forwards run under (eval mode).
    """

    def __init__(
        self,
        model: nn.Module,
        pad_id: int,
        eos_ids: Sequence[int],
        tokenizer=None,
        forward_mode: Callable | None = None,
        resume_cost: float = RESUME_PREFILL_COST,
        resume_max_wait: int = RESUME_MAX_WAIT,
    ) -> None:
        self.model, self.pad_id, self.eos_ids = model, pad_id, list(eos_ids)
        self.core = multimodal_core(model)  # a vision-language model's (None: text)
        self.image_token_id = None if self.core is None else int(self.core.config.image_token_id)
        self.tokenizer, self.forward_mode = tokenizer, forward_mode
        self.resume_cost, self.resume_max_wait = resume_cost, resume_max_wait
        self.s = _Samples()
        self.version = 0
        self.sampling: SamplingParams | None = None
        self._stop_table = np.zeros(0, dtype=bool)
        self._stop_check: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
        self.cache = None
        self.mask: Tensor | None = None  # [rows, columns] of the cache
        self.rows: list[int] = []  # the sample of each cache row (-1: dead)
        self.events: list[tuple[int, str]] = []
        self.live = 0
        self._added = 0
        self.stalled = False
        self.deferred = self.deferred_steps = 0
        self.steps = {"prefill_steps": 0, "decode_steps": 0}

    # ------------------------------------------------------------------ requests
    def add(
        self, prompt, keys, limits, sampling: SamplingParams, *, park: bool = False, images=None
    ):
        limits = np.asarray(limits, dtype=np.int64).reshape(-1)
        if images and self.core is None:
            raise ValueError(
                f"{WHERE}.add: a prompt with images, but the model has no vision tower"
            )
        drawing = sampling.drawing()
        if self.live and drawing != self.sampling:
            raise ValueError(
                f"{WHERE}.add: the samples in flight draw with {self.sampling}; a request "
                f"drawing with {drawing} must wait until they finish"
            )
        if not self.live:
            self._draw_with(drawing)
        s = self.s
        ids = s.take(len(limits), int(limits.max()))
        prompt = np.asarray(prompt, dtype=np.int64)
        for i in ids.tolist():
            s.prompt_of[i] = prompt
            s.media_of[i] = [dict(images)] if images else []
            s.pending_of[i] = list(s.media_of[i])
            s.marks_of[i] = []
        s.max_new[ids], s.keys[ids] = limits, np.asarray(keys, dtype=np.int64).reshape(-1)
        for name in ("gen", "ctx", "pos", "turn_start"):
            getattr(s, name)[ids] = 0
        s.row[ids] = -1
        for name in ("stopped", "finished", "running", "parked", "aborted"):
            getattr(s, name)[ids] = False
        s.waiting[ids], s.parks[ids] = True, park
        s.tokens[ids], s.log_probs[ids], s.versions[ids] = 0, 0.0, self.version
        s.order[ids] = self._added + np.arange(len(ids))
        self._added += len(ids)
        self.live += len(ids)
        return ids

    def _draw_with(self, drawing: SamplingParams) -> None:
        self.sampling = drawing
        stop_ids = [] if drawing.ignore_eos else list(self.eos_ids)
        stop_ids += [i for i in drawing.stop_token_ids if i not in stop_ids]
        table = np.zeros(max(stop_ids, default=-1) + 1, dtype=bool)
        table[np.asarray(stop_ids, dtype=np.int64)] = True
        self._stop_table = table
        self._stop_check = None
        if drawing.stop:
            if self.tokenizer is None:
                raise ValueError(f"{WHERE}: stop strings need a tokenizer.")
            self._stop_check = StopStrings(self.tokenizer, drawing.stop).checker(self)

    @property
    def tokens(self) -> np.ndarray:  # read by the stop-string checker
        return self.s.tokens

    @property
    def turn_start(self) -> np.ndarray:
        return self.s.turn_start

    def resume(self, sample: int, tokens, images: TurnImages | None = None) -> None:
        s, tokens = self.s, np.asarray(tokens, dtype=np.int64).reshape(-1)
        at, count = int(s.gen[sample]), len(tokens)
        if not s.parked[sample]:
            raise ValueError(f"{WHERE}: sample {sample} is not waiting for a turn.")
        if count == 0 or at + count >= s.max_new[sample]:
            raise ValueError(
                f"{WHERE}: sample {sample} has {at} of {s.max_new[sample]} response tokens; "
                f"appending {count} must leave room for one more."
            )
        if images is not None:
            if self.core is None:
                raise ValueError(f"{WHERE}.resume: images, but the model has no vision tower")
            s.media_of[sample].append(dict(images.inputs))
            s.pending_of[sample].append(dict(images.inputs))
            s.marks_of[sample].extend(int(at + o) for o in images.offsets)
        s.tokens[sample, at : at + count] = tokens
        s.log_probs[sample, at : at + count] = 0.0
        s.versions[sample, at : at + count] = self.version
        s.gen[sample] = s.turn_start[sample] = at + count
        s.parked[sample], s.waiting[sample] = False, True

    def finish(self, sample: int, stopped: bool) -> None:
        if not self.s.parked[sample]:
            raise ValueError(f"{WHERE}: sample {sample} is not waiting for a turn.")
        self.s.parked[sample] = False
        self.s.stopped[sample] = stopped
        self._end(sample)

    def abort(self, samples) -> None:
        s = self.s
        for i in [int(x) for x in samples]:
            if s.finished[i]:
                continue
            s.aborted[i] = True
            s.parked[i] = s.waiting[i] = s.running[i] = False
            self._end(i)

    def _end(self, sample: int) -> None:
        s = self.s
        s.finished[sample] = True
        s.running[sample] = False
        self.live -= 1
        if s.row[sample] >= 0:
            self.rows[s.row[sample]] = -1
            s.row[sample] = -1
        if not s.aborted[sample]:
            self.events.append((sample, DONE))

    def output(self, sample: int) -> SampleOutput:
        s, length = self.s, int(self.s.gen[sample])
        return SampleOutput(
            s.tokens[sample, :length].copy(),
            s.log_probs[sample, :length].copy(),
            s.versions[sample, :length].copy(),
            bool(s.stopped[sample]),
        )

    def release(self, samples) -> None:
        for i in [int(x) for x in samples]:
            if not self.s.finished[i]:
                raise ValueError(f"{WHERE}: sample {i} is not finished")
            self.s.prompt_of[i] = None
            self.s.media_of[i], self.s.pending_of[i], self.s.marks_of[i] = [], [], []
            self.s.free.append(i)

    # ------------------------------------------------------------------ steps
    def step(self) -> list[tuple[int, str]]:
        """One step (module docstring); the events since the last call."""
        s = self.s
        running = np.flatnonzero(s.running[: s.capacity])
        waiting = np.flatnonzero(s.waiting[: s.capacity])
        self.stalled = False
        if len(waiting) and self._prefill_due(len(running), len(waiting)):
            self._prefill(waiting)
        elif len(running):
            self._decode(running, len(waiting))
        else:
            self.stalled = self.live > 0
            if self.live == 0:
                self.cache, self.mask, self.rows = None, None, []
        events, self.events = self.events, []
        return events

    def _prefill_due(self, running: int, waiting: int) -> bool:
        if not running:
            return True
        if self.deferred_steps >= self.resume_max_wait:
            return True
        return self.deferred >= self.resume_cost * running

    def _prefill(self, samples: np.ndarray) -> None:
        """Feed each of ``samples`` what the cache lacks of its sequence (prompt and
        response so far), left-padded to the longest; draw each one's next token."""
        self._compact()
        s = self.s
        new = samples[s.row[samples] < 0]
        self._add_rows(new[np.argsort(s.order[new], kind="stable")])
        pieces = {}
        for i in samples.tolist():
            sequence = np.concatenate([s.prompt_of[i], s.tokens[i, : s.gen[i]]])
            pieces[i] = (sequence[s.ctx[i] :], self._positions(i, sequence))
        width = max(len(p) for p, _ in pieces.values())
        ids, mask, positions = self._blank(width)
        marks = np.zeros_like(mask, dtype=bool)
        for i, (piece, placed) in pieces.items():
            row, count = int(s.row[i]), len(piece)
            ids[row, width - count :] = piece
            mask[row, width - count :] = 1
            positions[:, row, width - count :] = placed[:, s.ctx[i] :]
            marks[row, width - count :] = self._placeholders(i, len(placed[0]))[s.ctx[i] :]
            s.ctx[i] += count
            s.pos[i] = int(placed[:, -1].max()) + 1
        logits = self._forward(ids, mask, positions, self._images(samples, marks))
        s.waiting[samples] = False
        self.deferred = self.deferred_steps = 0
        self.steps["prefill_steps"] += 1
        self._draw(samples, logits[torch.from_numpy(s.row[samples])])

    def _positions(self, sample: int, sequence: np.ndarray) -> np.ndarray:
        """The positions ``[3, len(sequence)]`` of a sample's whole sequence: the model's
        M-RoPE ones when it has images, else its token count (module docstring)."""
        s = self.s
        if not s.media_of[sample]:
            start = int(s.pos[sample]) - int(s.ctx[sample])  # a text sample's: 0
            return np.broadcast_to(start + np.arange(len(sequence)), (3, len(sequence)))
        assert self.core is not None  # `add` refuses images without a vision tower
        ids = torch.from_numpy(sequence)[None]
        marks = torch.from_numpy(self._placeholders(sample, len(sequence)))[None]
        grid = torch.cat([torch.as_tensor(m["image_grid_thw"]) for m in s.media_of[sample]])
        placed, _ = self.core.get_rope_index(
            ids, mm_token_type_ids=marks.int(), image_grid_thw=grid, attention_mask=None
        )
        return placed[:, 0].numpy()

    def _placeholders(self, sample: int, length: int) -> np.ndarray:
        """Where a sample's image placeholders are in its first ``length`` sequence tokens:
        its prompt's image tokens and its observations' placeholder columns."""
        s = self.s
        marks = np.zeros(length, dtype=bool)
        if not s.media_of[sample]:
            return marks
        prompt = s.prompt_of[sample]
        assert prompt is not None  # a live sample's
        marks[: len(prompt)] = prompt == self.image_token_id
        columns = np.asarray(s.marks_of[sample], dtype=np.int64) + len(prompt)
        marks[columns[columns < length]] = True
        return marks

    def _images(self, samples: np.ndarray, marks: np.ndarray) -> dict | None:
        """The images a prefill feeds (those of ``samples`` the cache has not seen, in
        cache-row order, as their placeholders ``marks`` run), or None."""
        s = self.s
        order = samples[np.argsort(s.row[samples], kind="stable")]
        fed = [m for i in order.tolist() for m in s.pending_of[i]]
        for i in samples.tolist():
            s.pending_of[i] = []
        if not fed:
            return None
        stacked = stack_images(fed)
        assert stacked is not None  # every entry holds images
        return {**stacked, "placeholders": marks}

    def _decode(self, samples: np.ndarray, waiting: int) -> None:
        """Feed each running sample its last drawn token; draw the next."""
        s = self.s
        ids, mask, positions = self._blank(1)
        rows = s.row[samples]
        ids[rows, 0] = s.tokens[samples, s.gen[samples] - 1]
        mask[rows, 0] = 1
        positions[:, rows, 0] = s.pos[samples]
        s.ctx[samples] += 1
        s.pos[samples] += 1
        logits = self._forward(ids, mask, positions)
        if waiting:
            self.deferred += waiting
            self.deferred_steps += 1
        self.steps["decode_steps"] += 1
        self._draw(samples, logits[torch.from_numpy(rows)])

    def _blank(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A step's inputs for every cache row, all holes: ids, mask, positions (three
        axes: M-RoPE's; a text model reads the first)."""
        rows = len(self.rows)
        return (
            np.full((rows, width), self.pad_id, dtype=np.int64),
            np.zeros((rows, width), dtype=np.int64),
            np.zeros((3, rows, width), dtype=np.int64),
        )

    def _forward(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, images: dict | None = None
    ) -> Tensor:
        """One forward over every cache row (``images``: the features put at their
        placeholders first); the float32 logits of each row's last column."""
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        ids_t, mask_t = (torch.from_numpy(a).to(device) for a in (ids, mask))
        pos_t = torch.from_numpy(positions if self.core is not None else positions[0]).to(device)
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
            self.mask = mask_t[:, :0]
        self.mask = torch.cat([self.mask, mask_t], dim=1)
        tokens: dict[str, Tensor | None] = {"input_ids": ids_t}
        with torch.no_grad():
            if images is not None:
                assert self.core is not None  # only a vision-language sample has images
                embeds = splice_image_features(
                    self.core,
                    ids_t,
                    images["pixel_values"].to(device),
                    images["image_grid_thw"].to(device),
                    torch.from_numpy(images["placeholders"]).to(device),
                )
                tokens = {"input_ids": None, "inputs_embeds": embeds}
            out = self.model(
                **tokens,
                attention_mask=self.mask,
                position_ids=pos_t,
                past_key_values=self.cache,
                use_cache=True,
                return_dict=True,
                **self._extra(),
            )
        return out.logits[:, -1].to(copy=True, dtype=torch.float32)

    def _extra(self) -> dict:
        import inspect

        if not hasattr(self, "_extra_kwargs"):
            params = inspect.signature(self.model.forward).parameters
            self._extra_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        return self._extra_kwargs

    def _draw(self, samples: np.ndarray, logits: Tensor) -> None:
        """Draw each sample's next token at its response column; end or park it."""
        s = self.s
        at = s.gen[samples]
        keys = torch.from_numpy(s.keys[samples]).to(logits.device)
        positions = torch.from_numpy(at).to(logits.device)
        if self.sampling is None:
            raise RuntimeError(f"{WHERE}: a draw before add() set the samples' sampling")
        chosen, log_probs = sample_tokens(logits, keys, positions, self.sampling)
        chosen = chosen.cpu().numpy()
        s.tokens[samples, at] = chosen
        s.log_probs[samples, at] = log_probs.float().cpu().numpy()
        s.versions[samples, at] = self.version
        s.gen[samples] = at + 1
        progress.tick(tokens=len(samples))
        table = self._stop_table
        inside = (chosen >= 0) & (chosen < len(table))
        stop = (
            inside & table[np.where(inside, chosen, 0)]
            if len(table)
            else np.zeros(len(chosen), bool)
        )
        if self._stop_check is not None:
            stop |= self._stop_check(samples, at + 1)
        s.stopped[samples] = stop
        room = at + 1 < s.max_new[samples]
        park = stop & room & s.parks[samples]
        s.running[samples] = ~(stop | ~room)
        for i in samples[(stop | ~room) & ~park].tolist():
            self._end(i)
        for i in samples[park].tolist():
            s.parked[i] = True
            self.events.append((i, TURN))

    # ------------------------------------------------------------------ the cache
    def _add_rows(self, samples: np.ndarray) -> None:
        """New cache rows for ``samples``: zeros under a 0 mask for the columns before."""
        if not len(samples):
            return
        first = len(self.rows)
        self.rows.extend(int(i) for i in samples)
        self.s.row[samples] = np.arange(first, first + len(samples))
        if self.cache is None:
            return
        count = len(samples)
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False) and layer.keys.numel():
                layer.keys = torch.cat(
                    [layer.keys, layer.keys.new_zeros((count, *layer.keys.shape[1:]))]
                )
                layer.values = torch.cat(
                    [layer.values, layer.values.new_zeros((count, *layer.values.shape[1:]))]
                )
        self.mask = torch.cat([self.mask, self.mask.new_zeros((count, self.mask.shape[1]))])

    def _compact(self) -> None:
        """Drop the rows of finished samples and the columns no live row attends to."""
        if self.cache is None:
            return
        keep = [r for r, i in enumerate(self.rows) if i >= 0]
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
            self.mask = self.mask.index_select(0, index)
            if keep:
                self.cache.batch_select_indices(index)
            self.rows = [self.rows[r] for r in keep]
            self.s.row[np.asarray(self.rows, dtype=np.int64)] = np.arange(len(self.rows))
        if not self.rows:
            self.cache, self.mask = None, None
            return
        used = self.mask.bool().any(0)
        if not bool(used.all()):
            columns = torch.nonzero(used).squeeze(1)
            self.mask = self.mask.index_select(1, columns)
            for layer in self.cache.layers:
                if getattr(layer, "is_initialized", False) and layer.keys.numel():
                    layer.keys = layer.keys.index_select(2, columns)
                    layer.values = layer.values.index_select(2, columns)
