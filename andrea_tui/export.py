"""A run's numbers out: one CSV row per step, and its charts as a PNG (matplotlib, the optional
`export` extra): the loss with the validation loss on its axes and alert marks, the grad norm on
a robust axis, the learning rate with resume and evaluation marks.

The step records come through engine.runfiles.read_steps (one per step, the later winning, the
abandoned-timeline and step-sequence rules applied); validation losses from valloss. What is written where:
- a new file, or with `force` a regular file replaced, always through a temporary file in the
  same directory renamed into place (a failure or a reader sees the old file or the new one);
- never anything that exists and is not a regular file: a symbolic link (whatever it points
  to), a directory, a device, a FIFO or a socket is refused, with or without `force`;
- `-` (STDOUT) is standard output (the command line's business: `andrea_tui.cli.export`).
The dashboard's and the runs browser's `e` write fresh names into the run directory, never over
anything. Headless: the Textual part is `export_in_background`, given an app.
"""

from __future__ import annotations

import csv
import errno
import io
import math
import os
import re
import secrets
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from andrea_tui import ticks
from andrea_tui.runstate import read_config
from andrea_tui.series import StepSeries, column_ranges, downsample_minmax
from andrea_tui.textfmt import fmt_grad
from andrea_tui.valloss import read_val_loss, val_by_step
from engine.errors import RunError, UserError
from engine.records import AlertEvent, ResumeEvent, StepRecord
from engine.runfiles import RunPaths, read_events, read_json, read_steps

STDOUT = "-"  # the target name that means standard output
PNG_SIZE = (1200, 900)
PNG_DPI = 100
MAX_PNG_SIDE = 10_000
NO_MATPLOTLIB = ("PNG export needs matplotlib, which is not installed here: "
                 "pip install 'andrea[export]' (or pip install matplotlib)")


def _resumes(run_dir: Path) -> list[ResumeEvent]:
    events, _ = read_events(RunPaths(run_dir).events)
    return [e for e in events if isinstance(e, ResumeEvent)]


def step_records(run_dir: Path) -> list[StepRecord]:
    """The run's step records (engine.runfiles.read_steps); UserError when there are none."""
    path = RunPaths(Path(run_dir)).loss
    records, _ = read_steps(path)
    if not records:
        raise UserError(f"{path}: no step records to export")
    return records


def csv_header(records: Sequence[StepRecord], with_val: bool) -> list[str]:
    """step, the step record's numbers (validation loss after the loss, when there is any),
    then one column per source weight and source loss and per rank's step time."""
    sources_w: dict[str, None] = {}
    sources_l: dict[str, None] = {}
    ranks = 0
    for r in records:
        sources_w.update(dict.fromkeys(r.weights))
        sources_l.update(dict.fromkeys(r.src_loss))
        ranks = max(ranks, len(r.rank_ms))
    head = ["step", "loss", *(["val_loss"] if with_val else []),
            *[c for c in StepRecord.NUMERIC if c != "loss"],
            "phase", "phase_step", "phase_len", "skipped"]
    head += [f"weights.{s}" for s in sources_w] + [f"src_loss.{s}" for s in sources_l]
    head += [f"rank_ms.{i}" for i in range(ranks)]
    return head


def _cell(v: Any) -> str:
    """A number as Python writes it back exactly (repr), NaN and infinities by name; unknown
    (None) as an empty cell."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return repr(v)  # 'nan', 'inf', '-inf' for the non-finite
    return str(v)


def _row(r: StepRecord, head: list[str], val: dict[int, float]) -> list[str]:
    out = []
    for name in head:
        if name == "val_loss":
            v: Any = val.get(r.step)
        elif name.startswith("weights."):
            v = r.weights.get(name[8:])
        elif name.startswith("src_loss."):
            v = r.src_loss.get(name[9:])
        elif name.startswith("rank_ms."):
            i = int(name[8:])
            v = r.rank_ms[i] if i < len(r.rank_ms) else None
        else:
            v = getattr(r, name)
        out.append(_cell(v))
    return out


def csv_text(run_dir: Path) -> tuple[str, list[int]]:
    """The CSV of a run (header and one row per step) and the steps of its rows."""
    run_dir = Path(run_dir)
    records = step_records(run_dir)
    val = val_by_step(run_dir, _resumes(run_dir))
    head = csv_header(records, bool(val))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for r in records:
        w.writerow(_row(r, head, val))
    return buf.getvalue(), [r.step for r in records]


_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISSOCK, "a socket"))


def refuse_existing(out: Path, force: bool) -> None:
    """UserError unless export may write `out`: a name that is free, or (with `force`) a regular
    file. A symbolic link (to anything, or dangling) and whatever is not a regular file are
    refused with or without `force`; nothing is followed or opened to find out."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise UserError(f"{out.parent}: not a directory") from None
    except OSError as e:
        raise UserError(f"{out}: cannot look at it ({e.strerror or e})") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise UserError(f"{out}: a symbolic link (to {os.readlink(out)}); export replaces "
                            "only regular files: name the file itself")
        for test, what in _NOT_REGULAR:
            if test(st.st_mode):
                raise UserError(f"{out}: {what}, not a regular file; export writes only "
                                f"regular files (or {STDOUT} for standard output)")
        if not force:
            raise UserError(f"{out}: already exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise UserError(f"{out.parent}: no such directory")


def _temp_beside(out: Path, data: bytes) -> Path:
    """`data` in a new file of its own in `out`'s directory (created exclusively, so never an
    existing file or a link; the usual permissions, as the umask says)."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o666)
    except OSError as e:
        raise UserError(f"{out}: cannot write: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException as e:  # a full disk, or Ctrl+C in the middle of a large PNG
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(f"{out}: cannot write: {e.strerror or e}") from None
        raise
    return tmp


def _keep_owner_and_mode(tmp: Path, out: Path) -> None:
    """Give the file that replaces `out` the mode of the one replaced (a private 0600 file
    stays private) and, where allowed, its owner and group."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    os.chmod(tmp, stat.S_IMODE(st.st_mode))
    try:
        os.chown(tmp, st.st_uid, st.st_gid)
    except OSError:
        pass  # only root may give a file away; the mode is kept all the same


def _link_new(tmp: Path, out: Path) -> bool:
    """Give `tmp` the name `out` only if that name is free (a hard link cannot replace anything);
    False when it is taken. Where the file system has no hard links, the name is checked and
    the temporary file renamed."""
    try:
        os.link(tmp, out)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK,
                           errno.ENOSYS):  # ENOSYS: some FUSE file systems
            raise
    if os.path.lexists(out):
        return False
    os.replace(tmp, out)
    return True


def write_file(out: Path, data: bytes, force: bool = False) -> None:
    """Write `data` as the file `out`: a new file, or with `force` a regular file replaced
    atomically (refuse_existing says what else is refused, and is asked again just before the
    rename). Without `force`, a file that appears meanwhile is not overwritten either."""
    out = Path(out)
    refuse_existing(out, force)
    tmp = _temp_beside(out, data)
    try:
        if force:
            refuse_existing(out, force)
            _keep_owner_and_mode(tmp, out)
            os.replace(tmp, out)
        elif not _link_new(tmp, out):
            raise UserError(f"{out}: already exists; pass --force to replace it")
    except OSError as e:
        raise UserError(f"{out}: cannot write: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def write_csv(run_dir: Path, out: Path, force: bool = False) -> int:
    """Write the run's CSV to `out`; the number of rows."""
    text, steps = csv_text(run_dir)
    write_file(Path(out), text.encode(), force)
    return len(steps)


def parse_size(text: str) -> tuple[int, int]:
    """'1200x900' -> (1200, 900); UserError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if not m or not all(64 <= int(g) <= MAX_PNG_SIDE for g in m.groups()):
        raise UserError(f"--size: expected WIDTHxHEIGHT in pixels, each 64..{MAX_PNG_SIDE}, "
                        f"got {text!r}")
    return int(m.group(1)), int(m.group(2))


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def mpl_round_ticks(axis: Any, kind: str = "value", log: bool = False) -> None:
    """Round ticks on a matplotlib axis (ax.xaxis, ax.yaxis), written as the terminal charts
    write them (andrea_tui.ticks): 1-2-5 steps, one label format for every tick; on a log axis
    powers of ten (and 2, 5 between them), each in its own shortest form."""
    from matplotlib.ticker import Formatter, LogLocator, MaxNLocator

    class RoundFormatter(Formatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return ticks.log_label(x, kind) if log and x > 0 else ticks.label(x, kind)

        def format_ticks(self, values: Any) -> list[str]:
            vals = [float(v) for v in values]
            if log or not all(math.isfinite(v) for v in vals):
                return [self(v) for v in vals]
            return ticks.tick_labels(vals, kind)

    if log:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=8))
    else:
        axis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))
    axis.set_major_formatter(RoundFormatter())


def _downsampled(x: np.ndarray, y: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    return downsample_minmax(x, y, cols)


def png_figure(run_dir: Path, size: tuple[int, int] = PNG_SIZE) -> Any:
    """The run's charts as a matplotlib Figure of `size` pixels: the training loss, its EMA and
    the validation loss on one axes (their gap read off one scale), with the engine's alerts as
    ticks along its top; the grad norm on a robust axis (ticks.grad_range: points above it on
    the top edge, the clip line when on scale); the learning rate with resume lines and
    evaluation ticks. All three by step, with round ticks."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(NO_MATPLOTLIB) from None
    run_dir = Path(run_dir)
    records = step_records(run_dir)
    series = StepSeries.from_records(records)
    steps = series.steps
    events, _ = read_events(RunPaths(run_dir).events)
    resumes = [e for e in events if isinstance(e, ResumeEvent)]
    alerts = [e for e in events if isinstance(e, AlertEvent) and e.step is not None
              and steps[0] <= e.step <= steps[-1]]
    vs, _, vl = read_val_loss(run_dir, resumes)
    cfg_obj = read_json(RunPaths(run_dir).config)
    cfg = read_config(cfg_obj) if cfg_obj is not None else None
    name = cfg.name if cfg else run_dir.name
    width, height = size
    fig = Figure(figsize=(width / PNG_DPI, height / PNG_DPI), dpi=PNG_DPI)
    FigureCanvasAgg(fig)
    ax_loss, ax_grad, ax_lr = fig.subplots(3, 1, sharex=True,
                                           gridspec_kw={"height_ratios": [3, 2, 1.2]})
    fig.suptitle(f"{name} · {run_dir} · steps {int(steps[0]):,}–{int(steps[-1]):,}", fontsize=10)
    cols = max(100, width)
    _draw_loss(ax_loss, series, vs, vl, alerts, cols)
    _draw_grad(ax_grad, series, cfg.optim.max_grad_norm if cfg is not None else None, alerts,
               cols)
    _draw_lr(ax_lr, series, resumes, vs, cols)
    mpl_round_ticks(ax_lr.xaxis, "count")
    for ax in (ax_loss, ax_grad, ax_lr):
        mpl_round_ticks(ax.yaxis, "value")
        ax.grid(True, alpha=0.3)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.94, bottom=0.07, hspace=0.15)
    return fig


def _draw_loss(ax: Any, series: StepSeries, vs: np.ndarray, vl: np.ndarray,
               alerts: list[AlertEvent], cols: int) -> None:
    """The loss, its EMA and the validation loss on one axes; the alerts along its top."""
    steps = series.steps
    x, y = _downsampled(steps, series.col("loss"), cols)
    ax.plot(x, y, color="0.7", linewidth=0.6, label="loss")
    ex, ey = _downsampled(steps, series.ema(), cols)
    ax.plot(ex, ey, color="tab:blue", linewidth=1.2, label=f"EMA ({series.ema_alpha:g})")
    if len(vs):
        ax.plot(vs, vl, color="tab:orange", marker="o", markersize=3, linewidth=1.0,
                label="validation loss")
    else:
        ax.text(0.99, 0.03, "no validation loss (no eval.jsonl)", ha="right", va="bottom",
                transform=ax.transAxes, color="0.4", fontsize=8)
    if alerts:
        ax.vlines([a.step for a in alerts], 0.93, 1.0, transform=ax.get_xaxis_transform(),
                  colors="tab:red", linewidth=1.2, label=f"alerts ({len(alerts)})")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)


def _draw_grad(ax: Any, series: StepSeries, clip: float | None, alerts: list[AlertEvent],
               cols: int) -> None:
    """The grad norm on its robust axis: points above it on the top edge, the clip line where
    it is on scale, the gradient alerts along the top."""
    steps = series.steps
    g = series.col("grad_norm")
    gx, glo, ghi = column_ranges(steps, g, cols)
    gx2, gy = _downsampled(steps, g, cols)
    yr = ticks.grad_range(g, glo, ghi, clip)
    ax.plot(gx2, gy if yr is None else np.clip(gy, yr.lo, yr.hi), color="tab:green",
            linewidth=0.6, label="grad norm")
    if yr is not None:
        ax.set_ylim(yr.lo, yr.hi)
        up = gx[ghi > yr.hi]
        if len(up):
            ax.plot(up, np.full(len(up), yr.hi), linestyle="none", marker="^",
                    color="tab:purple", markersize=5, clip_on=False,
                    label=f"{yr.above} above the axis")
        if yr.line is not None:
            ax.axhline(yr.line, color="tab:red", linewidth=0.8, linestyle="--",
                       label=f"clip {fmt_grad(yr.line).strip()}")
        elif yr.line_off_scale and clip is not None:
            ax.plot([], [], color="tab:red", linestyle="--",
                    label=f"clip {fmt_grad(clip).strip()}, off scale")
    grad_alerts = [a.step for a in alerts if a.alert in ("grad_spike", "nonfinite")]
    if grad_alerts:
        ax.vlines(grad_alerts, 0.9, 1.0, transform=ax.get_xaxis_transform(), colors="tab:red",
                  linewidth=1.2)
    ax.set_ylabel("grad norm")
    ax.legend(loc="upper right", fontsize=8)


def _draw_lr(ax: Any, series: StepSeries, resumes: list[ResumeEvent], vs: np.ndarray,
             cols: int) -> None:
    """The learning rate, a line at each resume and a tick at each evaluation."""
    steps = series.steps
    lx, ly = _downsampled(steps, series.col("lr"), cols)
    ax.plot(lx, ly, color="tab:blue", linewidth=1.0, label="learning rate")
    shown = [r.step for r in resumes if steps[0] <= r.step <= steps[-1]]
    for i, s in enumerate(shown):
        ax.axvline(s, color="tab:purple", linewidth=0.8, linestyle=":",
                   label="resume" if i == 0 else None)
    if len(vs):
        ax.vlines(vs, 0.0, 0.12, transform=ax.get_xaxis_transform(), colors="tab:orange",
                  linewidth=0.8, label="evaluation")
    ax.set_ylabel("learning rate")
    ax.set_xlabel("step")
    ax.legend(loc="upper right", fontsize=8)


def figure_png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI)
    return buf.getvalue()


def png_bytes(run_dir: Path, size: tuple[int, int] = PNG_SIZE) -> bytes:
    """The run's charts (png_figure) as a PNG of exactly `size` pixels."""
    return figure_png(png_figure(run_dir, size))


def write_png(run_dir: Path, out: Path, force: bool = False,
              size: tuple[int, int] = PNG_SIZE) -> None:
    refuse_existing(Path(out), force)  # before the drawing
    write_file(Path(out), png_bytes(run_dir, size), force)


def write_stdout(data: bytes) -> None:
    """`data` on standard output, flushed. A reader that went away (BrokenPipeError) is left to
    engine.errors.cli_entry; another failure (a full disk behind a redirection) is a RunError."""
    sys.stdout.flush()
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise RunError(f"standard output: cannot write: {e.strerror or e}") from None


def fresh_name(run_dir: Path, stem: str, suffix: str) -> Path:
    """`RUN_DIR/stem.suffix`, or `stem-2.suffix`, `-3`, ... when taken (by anything, a dangling
    link included)."""
    p = Path(run_dir) / f"{stem}{suffix}"
    n = 2
    while os.path.lexists(p):
        p = Path(run_dir) / f"{stem}-{n}{suffix}"
        n += 1
    return p


def write_fresh(run_dir: Path, stem: str, suffix: str, data: bytes) -> Path:
    """`data` under the first free name fresh_name gives: never an overwrite, even of a name
    taken between the look and the write."""
    while True:
        out = fresh_name(run_dir, stem, suffix)
        tmp = _temp_beside(out, data)
        try:
            if _link_new(tmp, out):
                return out
        except OSError as e:
            raise UserError(f"{out}: cannot write: {e.strerror or e}") from None
        finally:
            tmp.unlink(missing_ok=True)


def export_into_run(run_dir: Path) -> tuple[list[Path], str | None]:
    """The dashboard's `e`: the CSV and, with matplotlib, the PNG, written under fresh names
    `export-stepNNNNNNNN.csv/.png` in the run directory. (paths written, what was left out)."""
    run_dir = Path(run_dir)
    text, steps = csv_text(run_dir)
    stem = f"export-step{steps[-1]:08d}"
    written = [write_fresh(run_dir, stem, ".csv", text.encode())]
    if not have_matplotlib():
        return written, NO_MATPLOTLIB
    written.append(write_fresh(run_dir, stem, ".png", png_bytes(run_dir)))
    return written, None


def export_in_background(app: Any, run_dir: Path) -> None:
    """Run `export_into_run` in a thread worker of `app` (a Textual App) and tell the outcome
    as a toast."""

    def work() -> None:
        try:
            paths, left_out = export_into_run(run_dir)
        except UserError as e:
            app.call_from_thread(app.notify, str(e), title="export failed", severity="error")
            return
        names = ", ".join(p.name for p in paths)
        app.call_from_thread(app.notify, f"{names} in {run_dir}", title="exported")
        if left_out:
            app.call_from_thread(app.notify, left_out, severity="warning", timeout=10)

    app.notify(f"exporting {Path(run_dir).name}…", markup=False)
    app.run_worker(work, thread=True, group="export", exit_on_error=False)
