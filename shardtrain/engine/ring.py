"""Ring: forward-only passes of one slot's stage round the pipeline's ring.

The same route as training (0 -> 1 -> ... -> n-1 -> 0; slot 0 embeds and applies the
head) as checked messages, without autograd: used by evaluation (held-out losses, greedy
generation with a KV cache on every stage) and by distillation (the frozen reference's
next-token distributions, on its own message kind so it never meets the student's
activations). Every slot calls the same methods with the same token ids.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtrain.engine.batch import Batch
from shardtrain.engine.messages import ACTIVATION, Channel, MessageHeader
from shardtrain.engine.model import KVCache, Llama, rotary_tables
from shardtrain.engine.partition import Partition

__all__ = ["Documents", "Ring"]


class Documents(Protocol):
    """All `Ring.losses` needs of a job (`shardtrain.job.job.PreparedJob` is one): documents as batches."""

    def batch_of(self, indices: list[int]) -> Batch: ...


class Ring:
    """Forward passes of one slot's stage round the ring, with optional per-layer KV caches."""

    def __init__(
        self, stage: Llama, partition: Partition, slot: int, *, timeout: float, kind: int = ACTIVATION
    ) -> None:
        self.stage, self.config, self.slot, self.n = stage, stage.config, slot, partition.num_slots
        device = next(stage.parameters()).device
        self.dtype = next(stage.parameters()).dtype  # of the activations sent round the ring
        self.channel = (
            Channel(slot, timeout=timedelta(seconds=timeout), max_elements=1 << 26, device=device)
            if self.n > 1
            else None
        )
        self.calls = 0
        self.kind = kind  # the message kind (and so the tag) of this ring's activations

    def _header(self, b: int, t: int) -> MessageHeader:
        return MessageHeader(self.kind, self.calls, 0, self.dtype, (b, t, self.config.hidden_size))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, caches: dict[int, KVCache] | None = None) -> torch.Tensor | None:
        """(B, T) token ids (every slot knows them) -> (B, T, V) logits on slot 0, None elsewhere."""
        b, t = tokens.shape
        past = 0 if caches is None else next(iter(caches.values())).past if caches else 0
        header = self._header(b, t)
        self.calls += 1
        if self.slot == 0:
            h = self.stage.embed(tokens)  # (B, T, C)
        else:
            assert self.channel is not None
            h = self.channel.recv(self.slot - 1, header)  # (B, T, C)
        cos, sin = rotary_tables(self.config, past + t, h.device, h.dtype)
        cos, sin = cos[past:], sin[past:]  # (T, D) each: this call's positions
        for i in self.stage.layer_range:
            h = self.stage.layer(i, h, cos, sin, None if caches is None else caches.setdefault(i, KVCache()))
        if self.channel is not None:
            self.channel.send(h, (self.slot + 1) % self.n, header)
            if self.slot == 0:
                h = self.channel.recv(self.n - 1, header)
            self.channel.flush()
        return self.stage.logits(h) if self.slot == 0 else None  # (B, T, V)

    def _share(self, token: int) -> int:
        if self.n == 1:
            return token
        t = torch.tensor([token], dtype=torch.int64)
        dist.broadcast(t, src=0)
        return int(t.item())

    def generate(self, prompt: list[int], *, max_new_tokens: int, stop: set[int]) -> list[int]:
        """Greedy tokens after `prompt`, up to a stop token (included) or `max_new_tokens`."""
        caches: dict[int, KVCache] = {}
        logits = self.forward(torch.tensor([prompt]), caches)
        out: list[int] = []
        while True:
            token = self._share(int(logits[0, -1].argmax()) if logits is not None else -1)
            out.append(token)
            if (
                token in stop
                or len(out) >= max_new_tokens
                or len(prompt) + len(out) >= self.config.max_position_embeddings
            ):
                return out
            logits = self.forward(torch.tensor([[token]]), caches)

    def losses(self, job: Documents, indices: list[int], batch_size: int) -> tuple[list[float], list[float]]:
        """Per document: (sum of weighted token losses, sum of weights); only slot 0's are real."""
        doc_loss: list[float] = []
        doc_weight: list[float] = []
        for start in range(0, len(indices), batch_size):
            batch = job.batch_of(indices[start : start + batch_size])
            logits = self.forward(batch.tokens)
            if logits is None:
                continue
            ce = F.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none")  # (B, T)
            doc_loss += (ce.double() * batch.weights.double()).sum(dim=1).tolist()
            doc_weight += batch.weights.double().sum(dim=1).tolist()
        return doc_loss, doc_weight
