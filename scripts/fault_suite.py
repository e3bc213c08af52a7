"""The fault-injection suite: real engine runs (numpy backend, ANDREA-tiny or a micro model, in
a temporary directory), one per fault, and what the engine's alerts and health made of each.

    python scripts/fault_suite.py [--quick] [--only NAME[,NAME...]] [--jobs N] [--keep DIR]

Faults: the lr blown up at step 1 (lr 5 and 10, warm-up 1); a slow lr ramp (the lr grows 5% a
step from step 100) until the loss runs away; one poisoned batch (NaN gradients and loss); a
gradient spike inside another's cooldown (x100 at step 60, x5000 at step 99); a stall (the
engine's process SIGSTOPped for 3 s) and a hung step (4 s in one step, the process running);
a throughput drop (every step 0.1 s slower from step 100); the bandit moving 90% of the
mixture onto a harder source at step 250 (its rows random tokens, so its loss stays above
ln(vocab_size) while the model does not get worse); healthy runs of the shipped tiny config (three seeds, 1,000 steps each; with
--quick one seed, 300 steps).

It prints a markdown table: the fault, the step it began, the step its alert came (or
`missed`), the alert's kind, how many steps later, the health states the run went through and
whether that is what should happen; then the healthy runs' alerts per 1,000 steps. Exit status
0 when every row is as it should be, 1 otherwise, 2 for bad arguments.

Faults are injected in the engine's own process, never through a switch the engine reads: the
suite runs `python scripts/fault_suite.py --inject SPEC -- ENGINE-ARGS`, which patches the
trainer, sampler or bandit classes (`install`) and then calls engine.run.cli.main.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "ANDREA-tiny-TRAIN.json"
DATA_DIR = ROOT / "data" / "builtin"
HARD_SOURCE = "stdlib-docstrings"  # the source the mixture fault shuffles and moves onto
HARD_INDEX = 1  # its place in the config's sources
HEALTHY_MAX_PER_1K = 1.0  # alerts per 1,000 steps a healthy run may raise ...
TRAINING_KINDS = ("loss_spike", "grad_spike", "nonfinite", "diverging")  # ... about its training
# (`slow` and `stall` judge the machine: on a shared one, another program's load is told too)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # runs side by side: one BLAS thread each


# ---------------------------------------------------------------- in the engine's process


def install(spec: dict[str, Any]) -> None:
    """Patch the engine's classes for one fault (`spec`, see FAULTS), in this process."""
    import numpy as np

    from engine.data import bandit as bandit_mod
    from engine.data import sampler as sampler_mod
    from engine.train import trainer as trainer_mod

    trainer = trainer_mod.Trainer
    real_step, real_lr = trainer.step, trainer.lr_at

    def step(self: Any) -> Any:
        n = self.step_count + 1
        if n == spec.get("poison_step"):  # a batch whose gradients and loss are NaN
            self.backend.grad_array()[...] = np.nan
            self._row_losses = [np.full_like(x, np.nan) for x in self._row_losses]
        scale = spec.get("grad_scale", {}).get(str(n))
        if scale:
            self.backend.scale_grads(float(scale))
        if n == spec.get("hang_step"):
            time.sleep(float(spec["hang_s"]))
        if n >= spec.get("slow_from", math.inf):
            time.sleep(float(spec["slow_s"]))
        return real_step(self)

    def lr_at(self: Any, n: int) -> float:  # from ramp_from on: its lr, times growth a step
        k = spec.get("ramp_from")
        if k is None or n <= k:
            return real_lr(self, n)
        return real_lr(self, k) * float(spec["ramp_growth"]) ** (n - k)

    trainer.step, trainer.lr_at = step, lr_at  # type: ignore[method-assign]
    if "mix_at" not in spec:
        return
    sampler, bandit = sampler_mod.Sampler, bandit_mod.Bandit
    real_sample, real_observe, real_end = sampler.sample, bandit.observe, bandit._end_phase
    rng = np.random.default_rng(0)

    def sample(self: Any, batch: int, weights: Any) -> Any:
        tokens, src = real_sample(self, batch, weights)
        for row in np.flatnonzero(src == spec["hard"]):  # a harder source: random tokens
            tokens[row] = rng.integers(0, spec["vocab"], tokens.shape[1])
        return tokens, src

    def observe(self: Any, src_loss: Any) -> Any:
        self.steps_seen = getattr(self, "steps_seen", 0) + 1
        return real_observe(self, src_loss)

    def end_phase(self: Any) -> Any:
        change = real_end(self)
        if self.steps_seen >= spec["mix_at"] and not getattr(self, "moved", False):
            self.moved = True
            self.prefs = np.zeros_like(self.prefs)
            self.prefs[spec["hard"]] = 12.0
            self.weights = bandit_mod.mix_weights(self.prefs, self.floor)
            change = bandit_mod.PhaseChange(change.old_phase, change.new_phase,
                                            change.source_names, change.scores,
                                            self.weights.copy(), change.new_length)
        return change

    sampler.sample, bandit.observe, bandit._end_phase = sample, observe, end_phase  # type: ignore[method-assign]


# ---------------------------------------------------------------- the faults


@dataclass(frozen=True)
class Fault:
    """One engine run: `model` tiny or micro, config changes, the injection `spec`, what must
    come (`expect`: an alert kind at most `within` steps after the fault began; None: no
    `forbid` alert may come) and how the suite acts on the process (`sigstop_at`)."""

    name: str
    model: str
    steps: int
    spec: dict[str, Any] = field(default_factory=dict)
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    began: int | None = None  # None: found from the run (see began_at)
    expect: str | None = None
    within: int = 5
    forbid: tuple[str, ...] = ()
    sigstop_at: int | None = None
    seed: int | None = None


FAULTS = [
    Fault("lr 5, warm-up 1", "tiny", 30, changes={"optim": {"lr": 5.0, "warmup_steps": 1}},
          began=1, expect="diverging"),
    Fault("lr 10, warm-up 1", "tiny", 30, changes={"optim": {"lr": 10.0, "warmup_steps": 1}},
          began=1, expect="diverging"),
    Fault("slow lr ramp (x1.05 a step from step 100)", "micro", 300,
          spec={"ramp_from": 100, "ramp_growth": 1.05}, expect="diverging", within=5),
    Fault("one poisoned batch (NaN)", "micro", 100, spec={"poison_step": 60}, began=60,
          expect="nonfinite", within=0),
    Fault("grad spike x5000 inside a x100 one's cooldown", "micro", 140,
          spec={"grad_scale": {"60": 100, "99": 5000}}, began=99, expect="grad_spike",
          within=0),
    Fault("stall (SIGSTOP 3 s)", "micro", 260, changes={"alerts": {"stall_min_s": 1.0}},
          sigstop_at=150, expect="stall", within=1),
    Fault("hung step (4 s, process running)", "micro", 200,
          changes={"alerts": {"stall_min_s": 1.0}}, spec={"hang_step": 150, "hang_s": 4.0},
          began=149, expect="stall", within=0),
    Fault("throughput drop (+0.1 s a step)", "micro", 160, spec={"slow_from": 100,
                                                                  "slow_s": 0.1},
          began=100, expect="slow", within=12),
    Fault("mixture onto a harder source", "tiny", 400,
          spec={"mix_at": 250, "hard": HARD_INDEX, "vocab": 8449},
          forbid=("loss_spike", "diverging")),
]
HEALTHY_SEEDS = (1337, 1, 2)


def healthy(seed: int, steps: int) -> Fault:
    return Fault(f"healthy tiny, seed {seed}", "tiny", steps, seed=seed, forbid=TRAINING_KINDS)


def base_config(model: str) -> dict[str, Any]:
    c = json.loads(TINY.read_text())
    c["data"]["dir"] = str(DATA_DIR)
    if model == "micro":
        c["name"] = "ANDREA-micro"
        c["model"].update(n_layer=2, d_model=64, n_head=2, d_ff=128, seq_len=32)
        c["train"].update(batch_size=4)
        c["optim"].update(warmup_steps=5)
        c.pop("eval", None)
    c["checkpoint"].update(every=1_000_000, keep=1)
    c["samples"].update(every_steps=0)
    return c


def fault_config(f: Fault) -> dict[str, Any]:
    c = base_config(f.model)
    c["train"]["max_steps"] = f.steps
    if f.seed is not None:
        c["train"]["seed"] = f.seed
        c["bandit"]["seed"] = f.seed
    for section, values in f.changes.items():
        c.setdefault(section, {}).update(values)
    return c


# ---------------------------------------------------------------- running one


@dataclass
class Result:
    fault: Fault
    began: int | None
    alerts: list[dict[str, Any]]
    health: list[str]
    steps: int
    mixture_step: int | None = None  # the `mixture` event's step (a mixture fault)
    note: str = ""

    def first(self, kind: str | None) -> dict[str, Any] | None:
        after = self.began if self.began is not None else 0
        return next((a for a in self.alerts if a.get("kind") == kind
                     and (a.get("step") or 0) >= after), None)

    @property
    def ok(self) -> bool:
        f = self.fault
        if f.expect is not None:
            a = self.first(f.expect)
            if a is None or self.began is None or a["step"] - self.began > f.within:
                return False
        bad = [a for a in self.alerts if a.get("kind") in f.forbid]
        if "mix_at" in f.spec and (self.mixture_step is None or self.began is None
                                   or not 0 <= self.mixture_step - self.began <= 1):
            return False  # the move was not told as the event it is (within a step)
        if f.seed is not None:
            return self.rate(TRAINING_KINDS) <= HEALTHY_MAX_PER_1K and \
                not any(a.get("kind") == "diverging" for a in self.alerts)
        return not bad

    def rate(self, kinds: tuple[str, ...]) -> float:
        """Alerts of these kinds per 1,000 steps."""
        n = sum(a.get("kind") in kinds for a in self.alerts)
        return n / max(self.steps, 1) * 1000


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def last_step(run: Path) -> int:
    rows = read_jsonl(run / "loss.jsonl")
    return rows[-1]["step"] if rows else 0


def began_at(losses: list[float], start: int, rise: float = 1.0) -> int:
    """Where a runaway loss began (from the whole run, after the fact): the first step from
    `start` on after which the centred 11-step median of the loss stays more than `rise` nats
    above its lowest value so far."""
    import numpy as np

    x = np.asarray(losses, dtype=float)
    med = np.array([np.median(x[max(0, i - 5): i + 6]) for i in range(len(x))])
    low = np.minimum.accumulate(med[start - 1:])
    above = med[start - 1:] > low + rise
    began = len(above)
    while began > 0 and above[began - 1]:
        began -= 1
    return start + began


def run_fault(f: Fault, work: Path) -> Result:
    """Run one fault's engine in `work` (a fresh directory) and read what it wrote."""
    work.mkdir(parents=True, exist_ok=True)
    cfg, run = work / "config.json", work / "run"
    cfg.write_text(json.dumps(fault_config(f), indent=1))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--inject", json.dumps(f.spec), "--",
           str(cfg), "--run-dir", str(run), "--backend", "numpy"]
    log = open(work / "engine.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    began, health_seen = f.began, []
    try:
        if f.sigstop_at is not None:
            while last_step(run) < f.sigstop_at and proc.poll() is None:
                time.sleep(0.01)
            proc.send_signal(signal.SIGSTOP)
            time.sleep(0.3)  # the last record written before the stop
            began = last_step(run)
            time.sleep(2.7)
            proc.send_signal(signal.SIGCONT)
        while proc.poll() is None:  # the health as a viewer sees it, from state.json
            try:
                h = json.loads((run / "state.json").read_text()).get("health")
            except (OSError, ValueError):
                h = None
            if h and (not health_seen or health_seen[-1] != h):
                health_seen.append(h)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    events = read_jsonl(run / "events.jsonl")
    steps = read_jsonl(run / "loss.jsonl")
    alerts = [e for e in events if e.get("event") == "alert"]
    states = [e["state"] for e in events if e.get("event") == "health"]
    health = ["healthy", *states]
    for h in health_seen:  # states state.json showed between two events (none, normally)
        if h not in health:
            health.append(h)
    mix = next((e["step"] for e in events if e.get("event") == "phase"
                and e.get("weights", {}).get(HARD_SOURCE, 0) > 0.8), None)
    told = next((e["step"] for e in events if e.get("event") == "mixture"
                 and e.get("after", {}).get(HARD_SOURCE, 0) > 0.8), None)
    if "ramp_from" in f.spec:
        began = began_at([r["loss"] for r in steps], f.spec["ramp_from"])
    if "mix_at" in f.spec:
        began = mix
    note = "" if proc.returncode == 0 else f"engine exit {proc.returncode}"
    return Result(f, began, alerts, health, len(steps), told, note)


# ---------------------------------------------------------------- the table


def compress(states: list[str]) -> str:
    out: list[str] = []
    for s in states:
        if not out or out[-1] != s:
            out.append(s)
    return " → ".join(out)


def row(r: Result) -> str:
    f = r.fault
    if f.seed is not None:
        kinds = ", ".join(f"{a['kind']} {a['step']}" for a in r.alerts) or "none"
        return (f"| {f.name} | — | {kinds} | — | — | {compress(r.health)} | "
                f"{r.rate(TRAINING_KINDS):.2f} per 1,000 steps about training "
                f"({r.steps} steps) {'✓' if r.ok else '✗'} |")
    if f.expect is None:
        bad = [a for a in r.alerts if a.get("kind") in f.forbid]
        told = ", ".join(f"{a['kind']} {a['step']}" for a in bad) or "none"
        told += ("" if "mix_at" not in f.spec else
                 f"; mixture event at {r.mixture_step if r.mixture_step is not None else '—'}")
        return (f"| {f.name} | {r.began if r.began is not None else '—'} | {told} | "
                f"(none of {', '.join(f.forbid)} wanted) | — | {compress(r.health)} | "
                f"{'✓' if r.ok else '✗'} {r.note} |")
    a = r.first(f.expect)
    at = a["step"] if a else "missed"
    late = a["step"] - r.began if a and r.began is not None else "—"
    return (f"| {f.name} | {r.began if r.began is not None else '—'} | {at} | "
            f"{a['kind'] if a else f.expect} | {late} | {compress(r.health)} | "
            f"{'✓' if r.ok else '✗'} {r.note} |")


def table(results: list[Result]) -> str:
    lines = ["| fault | began at step | alert at step | kind | steps later | health | as it "
             "should be |", "|---|---|---|---|---|---|---|"]
    lines += [row(r) for r in results]
    well = [r for r in results if r.fault.seed is not None]
    if well:
        steps = sum(r.steps for r in well)
        n = sum(len(r.alerts) for r in well)
        train = sum(a.get("kind") in TRAINING_KINDS for r in well for a in r.alerts)
        lines.append("")
        lines.append(f"Healthy runs: {n} alert(s) in {steps:,} steps = "
                     f"{n / max(steps, 1) * 1000:.2f} per 1,000 steps; about their training "
                     f"({', '.join(TRAINING_KINDS)}) {train} = "
                     f"{train / max(steps, 1) * 1000:.2f} per 1,000 steps (at most "
                     f"{HEALTHY_MAX_PER_1K:g} wanted); the rest judge the machine (slow, "
                     "stall).")
    return "\n".join(lines)


def prepare_data() -> None:
    from engine.config import parse_config
    from engine.data.prep import prepare

    prepare(parse_config(base_config("tiny"), "tiny", ROOT), progress=lambda m: None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inject"]:  # the engine, with a fault patched in (see the module doc)
        if len(argv) < 3 or argv[2] != "--":
            print("fault_suite.py: --inject SPEC -- ENGINE-ARGS", file=sys.stderr)
            return 2
        try:
            spec = json.loads(argv[1])
        except ValueError as e:
            print(f"fault_suite.py: --inject: not JSON ({e})", file=sys.stderr)
            return 2
        install(spec)
        from engine.run.cli import main as engine_main

        return engine_main(argv[3:]) or 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one healthy run of 300 steps")
    p.add_argument("--only", default="", help="faults whose name contains one of these words")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (default 2)")
    p.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = p.parse_args(argv)
    if args.jobs < 1:
        print(f"fault_suite.py: --jobs: expected a positive integer, got {args.jobs}",
              file=sys.stderr)
        return 2
    faults = list(FAULTS) + ([healthy(HEALTHY_SEEDS[0], 300)] if args.quick else
                             [healthy(s, 1000) for s in HEALTHY_SEEDS])
    words = [w.strip().lower() for w in args.only.split(",") if w.strip()]
    if words:
        faults = [f for f in faults if any(w in f.name.lower() for w in words)]
        if not faults:
            print(f"fault_suite.py: --only {args.only!r}: no fault's name contains it",
                  file=sys.stderr)
            return 2
    prepare_data()
    base = args.keep or Path(tempfile.mkdtemp(prefix="andrea-faults-"))
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda i: run_fault(faults[i], base / f"{i:02d}"),
                                range(len(faults))))
    print(table(results))
    print(f"\n{len(faults)} runs in {time.monotonic() - t0:.0f} s"
          + (f"; run directories in {base}" if args.keep else ""))
    if not args.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
