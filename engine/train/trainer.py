"""The optimizer step of DESIGN §4 on top of any backend, and the Python API of DESIGN §10.

    zero_grads → per micro-batch: forward, backward (+=) → scale_grads(1/n_micro) →
    grad_norm (partial → final) → non-finite? skip, count, record → grad_scale when
    norm > max_norm → adamw(lr from the schedule) → record

The trainer owns the counters (optimizer step, Adam step, tokens, skipped steps) and the fp16
loss scale; the backend owns the buffers. Nothing here allocates per step beyond small records.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.backends import get_backend
from engine.backends.base import Backend, DeviceStep
from engine.config import Config
from engine.model.layout import ModelShapes, init_params, n_params, tensor_table
from engine.model.optim import clip_scale, lr_at


@dataclass(frozen=True)
class StepResult:
    """One optimizer step as the trainer saw it: the step number (1-based), the mean loss of its
    micro-batches, the global gradient norm before clipping, the clip scale (1.0, or
    max_norm/grad_norm), the learning rate, cumulative tokens, and whether the update was skipped
    (a non-finite norm). The run loop adds timing and the data mixture (engine.records.StepRecord).
    """

    step: int
    loss: float
    grad_norm: float
    clip_scale: float
    lr: float
    tokens: int
    skipped: bool


class LossScaler:
    """Dynamic loss scaling for fp16 compute: halve on overflow, double after a clean stretch."""

    def __init__(self, enabled: bool, scale: float = 2.0**16, growth_interval: int = 1000) -> None:
        self.enabled = enabled
        self.scale = scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale = min(self.scale * 2.0, 2.0**24)
                self.good_steps = 0
        else:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self.good_steps,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.enabled = bool(d["enabled"])
        self.scale = float(d["scale"])
        self.good_steps = int(d["good_steps"])
        self.growth_interval = int(d["growth_interval"])


class GradientReducer(Protocol):
    """Data parallelism, as the trainer sees it: `world` ranks, each with its own micro-batches;
    `reduce(backend)` replaces the backend's gradient buffer by the sum over all ranks (the same
    bits on every rank), so that every rank then takes the same optimizer step. `in_step`: the
    sum runs inside the backend's device step instead (DeviceStep.launch_step's reducer)."""

    world: int
    in_step: bool

    def reduce(self, backend: Any) -> None: ...


class Trainer:
    """`Trainer(config, backend="numpy"|"cuda")`: the model, its optimizer and one step at a time.
    `reducer`: the data-parallel gradient sum (engine.run.ddp), when this is one rank of many."""

    def __init__(self, config: Config, backend: str = "numpy", *,
                 dtype: Any = np.float32, gemm_plan: Mapping[str, Any] | None = None,
                 reducer: GradientReducer | None = None) -> None:
        """backend: its name (engine.backends.BACKEND_NAMES), built with the config's model,
        batch, precision and gpu section; dtype: the numpy backend's (float64 for gradient
        checks); gemm_plan: the GEMM algorithms a run recorded (gemm_plan.json), to use instead
        of timing them."""
        self.config = config
        self.shapes = ModelShapes.from_config(config.model)
        self.reducer = reducer
        self.world = reducer.world if reducer is not None else 1
        train = config.train
        cls = get_backend(backend)
        # grad_accum > 1: a micro-batch beyond the first forms its gradient on its own and adds
        # it whole, as a data-parallel all-reduce adds ranks' gradients (the same bits)
        self._separate = train.grad_accum > 1
        self.backend: Backend = cls(self.shapes, train.batch_size, train.precision, dtype,
                                    gpu=config.gpu, gemm_plan=gemm_plan,
                                    separate_micro=self._separate)
        # the whole step on the device, where the backend has one (the CUDA one-graph step)
        self._device: DeviceStep | None = self.backend.device_step()
        self.tensor_table = [
            {"name": t.name, "shape": list(t.shape), "offset": t.offset}
            for t in tensor_table(self.shapes)
        ]
        self.n_params = n_params(self.shapes)
        self.backend.load_params(init_params(self.shapes, train.seed))
        zeros = np.zeros(self.n_params, dtype=np.float32)
        self.backend.load_optimizer(zeros, zeros)
        # fp16 compute needs loss scaling (the numpy backend computes in fp32 or fp64 whatever
        # train.precision says)
        self.scaler = LossScaler(enabled=self.backend.precision == "fp16")
        self.step_count = 0  # completed optimizer steps (skipped ones included)
        self.adam_t = 0  # applied updates, for Adam's bias correction
        self.tokens = 0
        self.skipped_steps = 0
        self._row_losses: list[np.ndarray] = []
        self._micro_tokens = 0
        # the steps begun and not ended, oldest first: the tokens of one end_step runs, or
        # (step, lr, tokens) of one queued on the device
        self._begun: collections.deque[np.ndarray | tuple[int, float, int]] = collections.deque()
        self._prepared: np.ndarray | None = None  # prepare()'s tokens, for the next step

    def join(self, reducer: GradientReducer) -> None:
        """Become one rank of a data-parallel job (the reducer needs the backend's device)."""
        self.reducer = reducer
        self.world = reducer.world

    # -- the Python API of DESIGN §10 ---------------------------------------------------

    @property
    def params(self) -> np.ndarray:
        return self.backend.read_params()

    @property
    def grads(self) -> np.ndarray:
        return self.backend.read_grads()

    def zero_grads(self) -> None:
        self._idle("zero_grads")
        self.backend.zero_grads()
        self._row_losses = []
        self._micro_tokens = 0

    def forward_backward(self, tokens: np.ndarray) -> float:
        """One micro-batch: tokens `[B, T+1]`; accumulates gradients, returns the mean loss."""
        self._idle("forward_backward")
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        # After the first micro-batch each one's gradient is formed on its own and added
        # whole: accumulation then sums exactly what a data-parallel all-reduce sums.
        rows = self.backend.forward_backward(
            np.ascontiguousarray(inputs), np.ascontiguousarray(targets), self.scaler.scale,
            separate=self._separate and bool(self._row_losses),
        )
        self._row_losses.append(np.asarray(rows, dtype=np.float64))
        self._micro_tokens += inputs.size
        return float(np.mean(rows))

    def eval_loss(self, tokens: np.ndarray) -> np.ndarray:
        """Per-row mean loss of `tokens` `[B, T+1]` (B = train.batch_size), forward only: the
        parameters, gradients, optimizer state and the row losses of the step are untouched."""
        self._idle("eval_loss")
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        rows = self.backend.forward_loss(np.ascontiguousarray(tokens[:, :-1]),
                                         np.ascontiguousarray(tokens[:, 1:]))
        return np.asarray(rows, dtype=np.float64)

    @property
    def row_losses(self) -> np.ndarray:
        """Per-row losses of the micro-batches since `zero_grads`, in order."""
        return np.concatenate(self._row_losses) if self._row_losses else np.zeros(0)

    def lr_at(self, step: int) -> float:
        o = self.config.optim
        return lr_at(step, o.lr, o.warmup_steps, self.config.train.max_steps, o.min_lr_frac)

    def step(self) -> StepResult:
        """Clip + AdamW over the gradients accumulated since `zero_grads`; what happened."""
        self._idle("step")
        n_micro = len(self._row_losses)
        if n_micro == 0:
            raise RuntimeError("step() without forward_backward() since zero_grads()")
        o = self.config.optim
        step = self.step_count + 1
        lr = self.lr_at(step)
        if self.reducer is not None:
            self.reducer.reduce(self.backend)  # the gradient of the whole job, on every rank
        grad_mult = 1.0 / (n_micro * self.world * self.scaler.scale)
        if self._device is not None:
            # on the device, with the one-graph step's kernels: the same bits as train_step
            # with float32 gradients (so two ranks of one micro-batch match one rank of two,
            # clipped or not; a one-rank train_step may keep bf16 ones: gpu.grads_low_precision)
            b1, b2 = o.betas
            norm, scale = self._device.optimizer_step(
                grad_mult=grad_mult, lr=lr, beta1=b1, beta2=b2, eps=o.eps,
                weight_decay=o.weight_decay, t=self.adam_t + 1, max_norm=o.max_grad_norm)
            return self._stepped(step, lr, norm, scale)
        self.backend.scale_grads(grad_mult)
        norm = float(self.backend.grad_norm())
        finite = math.isfinite(norm)
        self.scaler.update(finite)
        scale = 1.0
        if finite:
            scale = clip_scale(norm, o.max_grad_norm)
            if scale < 1.0:
                self.backend.grad_scale(scale)
            self.adam_t += 1
            b1, b2 = o.betas
            self.backend.adamw(lr, b1, b2, o.eps, o.weight_decay, self.adam_t)
        else:
            self.skipped_steps += 1
        self.step_count = step
        self.tokens += self._micro_tokens * self.world
        return StepResult(step=step, loss=float(np.mean(self.row_losses)), grad_norm=norm,
                          clip_scale=scale, lr=lr, tokens=self.tokens, skipped=not finite)

    def train_step(self, tokens: np.ndarray) -> StepResult:
        """`zero_grads` → `forward_backward(tokens)` → `step()` for one micro-batch: the same
        step, and on a backend with a device step (Backend.device_step: the CUDA backend's
        one-graph step) in one backend call with one host read, the data-parallel all-reduce
        inside it (a reducer with `in_step`). The numbers it feeds the backend are those
        `step()` would use (grads·1/(world·loss_scale), the clip, lr and Adam's t)."""
        self.begin_step(tokens)
        return self.end_step()

    def _queues_steps(self) -> bool:
        """Whether begin_step queues the step on the device: the device step, with the
        data-parallel all-reduce inside it when there is one."""
        return self._device is not None and (self.reducer is None or self.reducer.in_step)

    def prepare(self, tokens: np.ndarray) -> None:
        """Hand over the next step's tokens `[B, T+1]` early: on a backend with a device step
        the host stages them (checks, the embedding-gradient buckets) while the step before
        still runs on the device. Then `begin_step()` without tokens."""
        if self._prepared is not None:
            raise RuntimeError("prepare() twice without begin_step()")
        tokens = np.array(tokens, dtype=np.int32)
        if self._device is not None and self._queues_steps():
            self._device.prepare_step(np.ascontiguousarray(tokens[:, :-1]),
                                      np.ascontiguousarray(tokens[:, 1:]))
        self._prepared = tokens

    def _idle(self, what: str) -> None:
        """Refuse what would read or change the state under a step queued on the device."""
        n = sum(isinstance(b, tuple) for b in self._begun)
        if n:
            raise RuntimeError(f"{what}(): {n} step(s) queued on the device; end_step() first")

    @property
    def queue_depth(self) -> int:
        """How many steps may be begun and not yet ended: two, so that the device starts the
        next step while the host reads the one before; one where the next step's loss scale
        depends on that one's outcome (fp16 on the device)."""
        return 1 if self._queues_steps() and self.scaler.enabled else 2

    @property
    def queued(self) -> int:
        """Steps begun and not yet ended."""
        return len(self._begun)

    def begin_step(self, tokens: np.ndarray | None = None) -> None:
        """The first half of `train_step` (tokens None: those given to `prepare`): on a
        backend with a device step the step is queued and the host is free until `end_step`
        (the training loop writes the previous step's records and draws the next batch
        meanwhile); elsewhere the tokens are kept and `end_step` runs the step. Up to
        `queue_depth` steps may be begun before the first of them is ended."""
        if len(self._begun) >= self.queue_depth:
            raise RuntimeError(f"begin_step(): {len(self._begun)} step(s) begun and not ended")
        if tokens is None:
            if self._prepared is None:
                raise RuntimeError("begin_step() without tokens or prepare()")
            tokens, staged = self._prepared, True
        else:
            if self._prepared is not None:
                raise RuntimeError("begin_step(tokens) after prepare(): tokens twice")
            tokens, staged = np.array(tokens, dtype=np.int32), False
        self._prepared = None
        if self._device is None or not self._queues_steps():
            self._begun.append(tokens)
            return
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        o = self.config.optim
        ahead = len(self._begun)  # steps queued before this one, each assumed to apply
        step = self.step_count + 1 + ahead
        lr = self.lr_at(step)
        b1, b2 = o.betas
        # data parallel: the all-reduce runs inside the step, bucket by bucket (the backend's)
        extra = {"reducer": self.reducer} if self.reducer is not None else {}
        self._device.launch_step(
            None if staged else np.ascontiguousarray(inputs),
            None if staged else np.ascontiguousarray(targets),
            loss_scale=self.scaler.scale, grad_mult=1.0 / (self.world * self.scaler.scale),
            lr=lr, beta1=b1, beta2=b2, eps=o.eps, weight_decay=o.weight_decay,
            t=self.adam_t + 1 + ahead, max_norm=o.max_grad_norm, **extra)
        self._begun.append((step, lr, inputs.size))

    def end_step(self) -> StepResult:
        """Wait for the oldest step `begin_step` started; what happened."""
        if not self._begun:
            raise RuntimeError("end_step() without begin_step()")
        begun = self._begun.popleft()
        if isinstance(begun, np.ndarray):
            # data parallel on the host: the ranks' gradients summed between backward and step
            self.zero_grads()
            self.forward_backward(begun)
            return self.step()
        step, lr, n_tokens = begun
        assert self._device is not None  # only a device step queues a (step, lr, tokens)
        rows, norm, clip = self._device.step_result()
        self._row_losses = [np.asarray(rows, dtype=np.float64)]
        self._micro_tokens = n_tokens
        return self._stepped(step, lr, norm, clip)

    def _stepped(self, step: int, lr: float, norm: float, clip: float) -> StepResult:
        """The bookkeeping after a step taken on the device (clip and the non-finite skip
        there): the loss scaler, Adam's t, the counts."""
        finite = math.isfinite(norm)
        self.scaler.update(finite)
        if finite:
            self.adam_t += 1
        else:
            self.skipped_steps += 1
            clip = 1.0
        self.step_count = step
        self.tokens += self._micro_tokens * self.world
        return StepResult(step=step, loss=float(np.mean(self.row_losses)), grad_norm=norm,
                          clip_scale=clip, lr=lr, tokens=self.tokens, skipped=not finite)

    # -- state for checkpoints -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters and loss-scale state (the arrays travel separately in model.ckpt)."""
        self._idle("state_dict")
        return {"step": self.step_count, "adam_t": self.adam_t, "tokens": self.tokens,
                "skipped_steps": self.skipped_steps, "loss_scale": self.scaler.state_dict()}

    def load_state(self, params: np.ndarray, m: np.ndarray, v: np.ndarray,
                   state: dict[str, Any]) -> None:
        self._idle("load_state")
        self.backend.load_params(params)
        self.backend.load_optimizer(m, v)
        self.step_count = int(state["step"])
        self.adam_t = int(state["adam_t"])
        self.tokens = int(state["tokens"])
        self.skipped_steps = int(state["skipped_steps"])
        if self.scaler.enabled and state["loss_scale"].get("enabled"):
            # fp16 on both sides; a checkpoint from another backend or precision starts afresh.
            self.scaler.load_state_dict(state["loss_scale"])
