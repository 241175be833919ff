"""Pipeline: one slot's share of a forward and backward pass over the whole batch.

Slots are the ranks of the default process group; slot s holds the stage built for it
(`build_stage`). Activations travel round the ring 0 -> 1 -> ... -> n-1 -> 0: slot 0
embeds the tokens and runs its layers, each later slot runs its layers, and slot 0
finally applies the final norm, the output head and the loss. Gradients travel back the
other way. With one slot the same code runs everything locally and sends nothing.

Schedule: the order of each slot's actions (forward, head on slot 0, backward of each
microbatch) comes from `shardtrain.engine.schedule`: ``overlapped`` (the default: stages work on
different microbatches at once, at most n + 2 microbatches' forward graphs held per slot)
or ``synchronous`` (every forward, then every head, then every backward). Both give
bitwise identical gradients, losses and so commits (the schedule module says why). Sends
are asynchronous so the ring cannot deadlock; the receives of the next few actions are
posted ahead (`Channel.post`) so that a message moves while its receiver computes, and
each wait has a timeout.

What a slot holds during a step: the forward graphs of the microbatches in flight (the
schedule's bound), the posted receive buffers of the next `PREFETCH` actions, each
microbatch's gradient message (b, t, C) until the step ends (Gloo reports a send done
only when waited for), and on slot 0 with a tied embedding the (b, t, C) gradients of
embedding backwards deferred until the last head has run.

Every decoder layer is its own autograd segment: its input is a detached leaf and its
output's gradient is pushed through it with `backward`. The autograd work per layer is
therefore the same wherever the layer lives and whatever its neighbours are, which is what
makes the gradients (and so the whole update) bitwise independent of the partition.

The loss of microbatch k (`shardtrain.engine.loss.microbatch_loss`: cross-entropy, plus KL toward a
frozen reference on declared replay rows) is divided by the total weight of the whole batch;
the step loss is the sum over microbatches, so microbatching does not change the update.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtrain.engine.batch import Batch, Microbatch, split_microbatches
from shardtrain.engine.loss import DistillTargets, microbatch_loss
from shardtrain.engine.messages import ACTIVATION, GRADIENT, Channel, MessageHeader, PostedRecv
from shardtrain.engine.model import Llama, rotary_tables
from shardtrain.engine.partition import Partition
from shardtrain.engine.profile import run_block
from shardtrain.engine.schedule import FORWARD, HEAD, Action, build
from shardtrain.errors import ConfigError

__all__ = ["Pipeline", "PREFETCH"]

PREFETCH = 3
"""How many actions ahead a slot posts its receives."""


@dataclasses.dataclass
class _Segments:
    """What one microbatch's forward left behind on this slot for its backward."""

    first: torch.Tensor  # slot 0: the embedding output (has a graph); else the received activation
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # (input leaf, output) per owned layer, in order
    last: torch.Tensor  # what this slot hands on (output of its last layer, or `first`)


class Pipeline:
    """Runs slot `slot`'s part of forward and backward; gradients accumulate in the stage."""

    def __init__(
        self,
        stage: Llama,
        partition: Partition,
        slot: int,
        *,
        timeout: timedelta = timedelta(seconds=300),
        max_message_elements: int = 1 << 28,
        schedule: str = "overlapped",
        compute: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        recompute: bool = False,
    ) -> None:
        """`compute` makes the context every forward computation runs in (the numerical
        profile's autocast, `shardtrain.engine.profile.compute_context`); `recompute` runs each
        decoder block under activation checkpointing (`shardtrain.engine.profile.run_block`)."""
        build(schedule, partition.num_slots, 1)  # refuse an unknown schedule now, not at the first step
        self.schedule = schedule
        self.compute, self.recompute = compute, recompute
        self.stage = stage
        self.config = stage.config
        self.partition = partition
        self.slot = slot
        self.num_slots = partition.num_slots
        if (
            stage.layer_range != partition.layers(slot)
            or stage.has_embedding != (slot == 0)
            or stage.has_head != (slot == 0)
        ):
            raise ConfigError(f"stage does not match slot {slot} of the partition")
        self.device = next(stage.parameters()).device
        self.dtype = next(stage.parameters()).dtype  # of the activations and gradients sent round the ring
        self.channel: Channel | None = None
        self._posted: dict[tuple[int, int, int], PostedRecv] = {}  # (src, kind, microbatch) -> posted receive
        # Called as after_forward(step, microbatch) once this slot has run a microbatch's
        # forward; the lifecycle's fault injection uses it to lose a worker mid-update.
        self.after_forward: Callable[[int, int], None] | None = None
        # Slot 0 only: the next batch's declared replay rows and reference log-probs
        # (shardtrain.run.distill sets it before each step; None: cross-entropy only).
        self.distill: DistillTargets | None = None
        if self.num_slots > 1:
            if not dist.is_initialized():
                raise ConfigError(f"a {self.num_slots}-slot pipeline needs an initialised process group")
            if dist.get_world_size() != self.num_slots or dist.get_rank() != slot:
                raise ConfigError(
                    f"slot {slot} of {self.num_slots} must run as rank {slot} of a group of "
                    f"{self.num_slots}, not rank {dist.get_rank()} of {dist.get_world_size()}"
                )
            self.channel = Channel(slot, timeout=timeout, max_elements=max_message_elements, device=self.device)

    @property
    def bytes_sent(self) -> int:
        return 0 if self.channel is None else self.channel.bytes_sent

    @property
    def wait_seconds(self) -> float:
        """Time this slot has spent blocked waiting for messages (0 with one slot)."""
        return 0.0 if self.channel is None else self.channel.wait_seconds

    def forward_backward(self, batch: Batch, *, step: int, microbatch_size: int) -> float | None:
        """Accumulate this slot's gradients for `batch`; return the step loss on slot 0.

        Every slot must be called with the same batch (only slot 0 reads its values; the
        others derive message shapes from it). Returns None on slots other than 0.
        """
        batch.validate(self.config.vocab_size, self.config.max_position_embeddings)
        mbs = split_microbatches(batch, microbatch_size)
        total_weight = batch.total_weight().to(self.device)
        plan = build(self.schedule, self.num_slots, len(mbs))[self.slot]
        saved: dict[int, _Segments] = {}
        values: dict[int, float] = {}  # slot 0: each microbatch's loss
        local_grads: dict[int, torch.Tensor] = {}  # one slot: the head's gradient, handed over locally
        # A tied embedding also receives the head's gradient: its embedding backwards wait
        # until every head has run, as in the synchronous order (see shardtrain.engine.schedule).
        tied = self.slot == 0 and self.config.tie_word_embeddings
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._posted = {}
        for i, action in enumerate(plan):
            self._prefetch(plan[i : i + PREFETCH], mbs, step)
            mb = mbs[action.microbatch]
            if action.kind == FORWARD:
                saved[mb.index] = self._forward(batch, mb, step)
                if self.after_forward is not None:
                    self.after_forward(step, mb.index)
            elif action.kind == HEAD:
                values[mb.index], grad = self._head(batch, mb, step, saved[mb.index].last, total_weight)
                if grad is not None:
                    local_grads[mb.index] = grad
                if len(values) == len(mbs):
                    for first, g in deferred:
                        first.backward(g)  # into the embedding, in microbatch order
                    deferred = []
            else:
                seg = saved.pop(mb.index)  # the microbatch's graph is freed with its backward
                nxt = (self.slot + 1) % self.num_slots
                grad = local_grads.pop(mb.index) if self.num_slots == 1 else self._recv(nxt, GRADIENT, mb, step)
                if self.channel is not None:  # the gradient's sender has received our activation
                    self.channel.settle(nxt, ACTIVATION, mb.index)
                first_grad = self._backward(seg, grad, mb, step)
                if first_grad is not None:
                    if tied and len(values) < len(mbs):
                        deferred.append((seg.first, first_grad))
                    else:
                        seg.first.backward(first_grad)  # into the embedding
        assert not saved and not deferred and not self._posted
        if self.channel is not None:
            self.channel.flush()
        if self.slot != 0:
            return None
        loss = 0.0
        for k in range(len(mbs)):  # microbatch order; the step loss is a float64 sum
            loss += values[k]
        return loss

    def _needs(self, action: Action) -> tuple[int, int] | None:
        """(source slot, message kind) of the message `action` waits for on this slot, if any."""
        if self.num_slots == 1:
            return None
        if action.kind == FORWARD:
            return None if self.slot == 0 else (self.slot - 1, ACTIVATION)
        if action.kind == HEAD:
            return (self.num_slots - 1, ACTIVATION)
        return ((self.slot + 1) % self.num_slots, GRADIENT)

    def _prefetch(self, actions: tuple[Action, ...], mbs: list[Microbatch], step: int) -> None:
        assert self.channel is not None or self.num_slots == 1
        for action in actions:
            need = self._needs(action)
            if need is None or (need[0], need[1], action.microbatch) in self._posted:
                continue
            src, kind = need
            mb = mbs[action.microbatch]
            assert self.channel is not None
            self._posted[(src, kind, mb.index)] = self.channel.post(src, self._header(kind, mb, step))

    def _header(self, kind: int, mb: Microbatch, step: int) -> MessageHeader:
        return MessageHeader(kind, step, mb.index, self.dtype, (mb.rows, mb.length, self.config.hidden_size))

    def _recv(self, src: int, kind: int, mb: Microbatch, step: int) -> torch.Tensor:
        assert self.channel is not None
        posted = self._posted.pop((src, kind, mb.index), None)
        if posted is None:
            return self.channel.recv(src, self._header(kind, mb, step))
        return self.channel.wait(posted)

    def _send(self, t: torch.Tensor, dst: int, kind: int, mb: Microbatch, step: int) -> None:
        assert self.channel is not None
        self.channel.send(t, dst, self._header(kind, mb, step))

    def _forward(self, batch: Batch, mb: Microbatch, step: int) -> _Segments:
        with self.compute():
            if self.slot == 0:
                first = self.stage.embed(mb.take(batch.tokens).to(self.device))  # (b, t, C)
            else:
                first = self._recv(self.slot - 1, ACTIVATION, mb, step)  # (b, t, C)
            cos, sin = rotary_tables(self.config, mb.length, self.device, first.dtype)  # (t, D) each
            x, layers = first, []
            for i in self.stage.layer_range:
                inp = x.detach().requires_grad_()
                x = run_block(self.stage.layer, i, inp, cos, sin, recompute=self.recompute)  # (b, t, C)
                layers.append((inp, x))
        if self.num_slots > 1:
            self._send(x, (self.slot + 1) % self.num_slots, ACTIVATION, mb, step)
        return _Segments(first, layers, x)

    def _head(
        self, batch: Batch, mb: Microbatch, step: int, local_last: torch.Tensor, total_weight: torch.Tensor
    ) -> tuple[float, torch.Tensor | None]:
        """Slot 0: final norm, head and weighted loss of one microbatch.

        Sends the gradient of the last activation back to slot n-1, or returns it when
        this is the only slot.
        """
        if self.num_slots > 1:
            h = self._recv(self.num_slots - 1, ACTIVATION, mb, step)
        else:
            h = local_last.detach()
        h = h.requires_grad_()  # (b, t, C) leaf
        targets = mb.take(batch.targets).to(self.device)  # (b, t)
        weights = mb.take(batch.weights).to(self.device)  # (b, t)
        with self.compute():
            logits = self.stage.logits(h)  # (b, t, V); bf16 under autocast
            # The loss is taken in at least FP32 (as transformers' loss functions do): a bf16
            # log-softmax would round every token's loss to 8 significant bits.
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss = microbatch_loss(
                logits, targets, weights, total_weight, rows=(mb.start, mb.stop), distill=self.distill
            )
        loss.backward()
        assert h.grad is not None
        if self.num_slots > 1:
            self._send(h.grad, self.num_slots - 1, GRADIENT, mb, step)
            return float(loss.detach()), None
        return float(loss.detach()), h.grad

    def _backward(self, seg: _Segments, grad: torch.Tensor, mb: Microbatch, step: int) -> torch.Tensor | None:
        """Backward through this slot's layers; send the input gradient on, or on slot 0
        return the gradient of the embedding output (the caller applies it)."""
        for inp, out in reversed(seg.layers):
            out.backward(grad)
            assert inp.grad is not None
            grad = inp.grad
        if self.slot == 0:
            return grad
        self._send(grad, self.slot - 1, GRADIENT, mb, step)
        return None
