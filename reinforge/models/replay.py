"""The rollout's activations, kept by the native engine's decoding for the learner's first backward.

An on-policy RL step computes every sampled token's activations twice at the same weights: the engine's
decoding runs each token through every layer to sample the next one, and the learner's forward runs them
again to take the gradient. Where the engine samples in this process from the learner's own fp32 weights
(`Rollout.logprobs_exact`) and no optimizer step has come between, the two agree to float rounding, so the
learner's first mini-batch can take what its backward needs (per layer: rotated queries, keys and values, the
attention's output and log-sum-exp, the residual after it, gate|up and the layer's output) from the decoding
(csrc/decode_layer.h, `Record`) and skip its own forward over the completion tokens (`kernels.replay_layer`).
The record holds the completion tokens the decoding read, and a row's learner pass covers exactly those (its last
token, which no one reads, is never fed back). The prompts' pass is the engine's prefill, kept alike where it ran
in one chunk (`PromptRecord`): the learner's prompt pass replays it for prompts it finds there token for token.

One record is a buffer [layers, rows, T, width] that the engine reuses from one generation to the next. A
learner replays a record only where `matches` its model: the buffer still holds the record's generation, the
model's parameters are the very tensors, at the very versions, that the decoding read (an in-place update bumps a
tensor's version counter), and no optimizer has taken a step since (a fused optimizer step updates the tensors
without bumping their versions, so every step in the process is counted). Anywhere else (a reference or critic
model, a mini-batch after the first optimizer step, rows sampled before an update) it runs its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from reinforge.kernels import LayerRecord, load_cpu_kernels

if TYPE_CHECKING:
    from reinforge.models.decoder import DecoderWeights

_GATE_UP = 5            # gate|up's place among a record row's fields (`RecordShape.sizes`)
_FIELDS = ("q", "k", "v", "attn", "lse", "x_mid", "gate_up", "x_out")    # a LayerRecord's tensors
_OPTIMIZER_STEPS = [0]   # steps any optimizer of this process has taken (`weights_key`)


def _count_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


@dataclass(frozen=True)
class RecordShape:
    """The widths of a record row (csrc/decode_layer.h, `Record::width_of`)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def sizes(self) -> list[int]:
        """Floats of each field of a token's row, in order: q, k, v, attn, x_mid, gate|up, x_out, lse."""
        h, kv, d, e = self.heads, self.kv_heads, self.head_dim, self.hidden
        return [h * d, kv * d, kv * d, h * d, e, 2 * self.intermediate, e, h]

    @property
    def width(self) -> int:
        """A row's floats: the fields padded to whole 64-byte lines."""
        return (sum(self.sizes) + 15) // 16 * 16


def weights_key(model: torch.nn.Module) -> tuple:
    """Which parameter tensors `model` computes with, at which version (in-place updates bump it), and after how
    many optimizer steps of this process."""
    return _OPTIMIZER_STEPS[0], tuple((id(p), p._version) for p in model.parameters())


@dataclass
class RecordBuffer:
    """The engine's reusable record memory: `data` [layers, rows, T, width] float32, `generation` bumped every
    time a decoding writes into it."""

    data: torch.Tensor
    generation: int = 0


@dataclass(frozen=True)
class PromptRecord:
    """The engine's prefill of a generation's prompts, right-padded to `width`: each layer's activations
    (`kernels.record_layer`) at tokens [P, width], and which row holds which prompt's tokens."""

    layers: list[LayerRecord]
    rows: dict[tuple[int, ...], int]
    width: int

    def select(self, ids: torch.Tensor, lengths: torch.Tensor, span: int) -> list[LayerRecord] | None:
        """The layers' records of prompts ids [B, >= span] (row b's tokens ids[b, :lengths[b]]) at positions
        0..span-1, in a learner pass's layout; None where a prompt is not among these or is wider than the prefill.
        Past a prompt's length the prefill ran padding, not the tokens the learner's row holds there: causal, no
        query of the prompt sees those positions, and the learner reads nothing of them (a completion attends to
        its prompt's own keys only), so their gradient is 0 either way."""
        if span > self.width:
            return None
        found = [self.rows.get(tuple(row[:n].tolist())) for row, n in zip(ids, lengths.tolist(), strict=True)]
        if any(r is None for r in found):
            return None
        index = torch.tensor(found)
        if span == self.width and torch.equal(index, torch.arange(len(index))) and len(index) == self._count:
            return self.layers

        def take(t: torch.Tensor) -> torch.Tensor:   # q, k, v, lse are [P, width, ...]; the others [P width, n]
            if t.dim() > 2:
                return t[index, :span].contiguous()
            return t.view(self._count, self.width, -1)[index, :span].reshape(-1, t.shape[1])

        return [LayerRecord(**{f: take(getattr(r, f)) for f in _FIELDS}) for r in self.layers]

    @property
    def _count(self) -> int:
        return self.layers[0].q.shape[0]


@dataclass
class Lent:
    """The weights a decoding read (`DecoderWeights`), while they hold what it read: the engine clears `weights`
    before any later call writes into their tensors (`DecoderWeights.reusable`, the engine's spare memory)."""

    weights: DecoderWeights | None


@dataclass(frozen=True)
class ActivationRecord:
    """The activations one generation kept, for the rollout's rows: row r's completion token t (t < T, every
    token the decoding read) at buffer.data[:, rows[r], t]. Rows a row selection keeps follow `rows`."""

    buffer: RecordBuffer
    generation: int               # the buffer's generation this record was written in
    rows: torch.Tensor            # [N] long, each rollout row's row of the buffer
    shape: RecordShape
    weights: tuple               # `weights_key` of the model whose weights the decoding read
    prompts: PromptRecord | None = None    # the prefill of its prompts at the same weights, where kept
    # The engine's weights that decoded it, until the engine writes over them: where the record matches, they are
    # the model's as it is now, and the learner takes their fused projections (`DecoderWeights.of`'s `fused_from`).
    decoded_with: Lent | None = None

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether these are `model`'s activations as it is now: the buffer still holds this record (the engine
        has not decoded into it since) and the model computes with the weights the decoding read, unchanged."""
        return self.buffer.generation == self.generation and weights_key(model) == self.weights

    @property
    def decoding_weights(self) -> DecoderWeights | None:
        """The engine's weights that decoded this record while they still hold what it read (`Lent`), else None."""
        return None if self.decoded_with is None else self.decoded_with.weights

    def select(self, rows: torch.Tensor) -> ActivationRecord:
        """The record of rows `rows` (indices into this record's rows)."""
        return ActivationRecord(self.buffer, self.generation, self.rows[rows], self.shape, self.weights, self.prompts,
                                self.decoded_with)

    def prompt_layers(self, ids: torch.Tensor, lengths: torch.Tensor, span: int) -> list[LayerRecord] | None:
        """The prefill's records of prompts ids [B, >= span] of `lengths` at positions 0..span-1
        (`PromptRecord.select`); None where it was not kept or does not hold them all."""
        return None if self.prompts is None else self.prompts.select(ids, lengths, span)

    @property
    def kept(self) -> int:
        """Completion positions kept per row."""
        return self.buffer.data.shape[2]

    def layers(self, rows: torch.Tensor, positions: int) -> list[LayerRecord]:
        """Each layer's `LayerRecord` of this record's rows `rows` [B] (indices into `self.rows`) at completion
        positions 0..positions-1, in `kernels.replay_layer`'s layout: contiguous copies (csrc/step.cpp,
        `record_gather`), except gate|up, which the backward reads in the buffer itself (`LayerRecord.gate_up_rows`;
        copied out it was most of the gather's time). A position past a row's tokens holds zeros (finite: no one
        reads it, and its gradient is 0)."""
        if positions > self.kept:
            raise ValueError(f"the record keeps {self.kept} positions a row, not {positions}")
        b, s = len(rows), positions
        h, kv, d = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        sizes = self.shape.sizes
        tokens = (self.rows[rows][:, None] * self.kept + torch.arange(s)[None, :]).flatten()    # [B S]: r T + t
        copy = [int(f != _GATE_UP) for f in range(len(sizes))]
        fields = load_cpu_kernels().record_gather(self.buffer.data, tokens, sizes, copy)
        buffer, generation = self.buffer, self.generation
        slabs = buffer.data.view(buffer.data.shape[0], -1, buffer.data.shape[3])      # [layers, R T, width]
        out = []
        for layer, at in enumerate(range(0, len(fields), len(sizes))):
            q, k, v, attn, x_mid, _, x_out, lse = fields[at : at + len(sizes)]
            out.append(LayerRecord(q=q.view(b, s, h, d), k=k.view(b, s, kv, d), v=v.view(b, s, kv, d), attn=attn,
                                   lse=lse.view(b, s, h), x_mid=x_mid, gate_up=slabs[layer], x_out=x_out,
                                   gate_up_rows=tokens, gate_up_offset=sum(sizes[:_GATE_UP]),
                                   intact=lambda: buffer.generation == generation))
        return out


def concat_records(parts: list[ActivationRecord | None]) -> ActivationRecord | None:
    """The record of rollouts concatenated in order: their rows, where every part kept its activations in the
    same generation of one buffer; else None."""
    first = parts[0] if parts else None
    if first is None or any(p is None or p.buffer is not first.buffer or p.generation != first.generation
                            or p.weights != first.weights for p in parts):
        return None
    prompts = first.prompts if all(p.prompts is first.prompts for p in parts) else None
    decoded_with = first.decoded_with if all(p.decoded_with is first.decoded_with for p in parts) else None
    return ActivationRecord(first.buffer, first.generation, torch.cat([p.rows for p in parts]), first.shape,
                            first.weights, prompts, decoded_with)
