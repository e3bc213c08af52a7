"""The flex attention backward (gpu.flex_backward) in the CUDA backend, on the CPU: whether it
runs (flex_attn.refusal and AttentionChoice.pick_flex on a choice made without a GPU), where its
library comes from, its buffers in the memory plan, and Ops.attn_bwd_cudnn's choice between it
and cuDNN's backward.
Its run on a GPU: tests/gpu/test_flex_gpu.py."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine import env
from engine.backends.cuda import flex_attn
from engine.backends.cuda.attention_choice import AttentionChoice
from engine.backends.cuda.buffers import plan_memory
from engine.backends.cuda.flex_call import scratch_bytes
from engine.backends.cuda.flex_plan import FIELDS, causal_plan
from engine.backends.cuda.memory import Plan
from engine.backends.cuda.ops import Ops
from engine.errors import RunError
from engine.model.layout import ModelShapes

OK = {"attention": "cudnn", "rows": True, "precision": "bf16", "head_dim": 64, "seq_len": 1024,
      "capability": (9, 0)}


def test_it_runs_only_where_its_kernels_do() -> None:
    assert flex_attn.refusal(**OK) == ""
    for change, said in (({"attention": "classic"}, "needs cuDNN's attention, and the classic"),
                         ({"rows": False}, "needs Q, K, V in rows, and cuDNN runs them as "
                                           "slabs (gpu.qkv_rows is false)"),
                         ({"rows": False, "rows_off": "why"}, "as slabs (why)"),
                         ({"precision": "fp16"}, "computes in bf16 only, not fp16"),
                         ({"head_dim": 128}, "needs head dim 64 (d_model / n_head), the model "
                                             "has 128"),
                         ({"seq_len": 1000}, "needs seq_len a multiple of 128, got 1000"),
                         ({"capability": (10, 0)}, "this GPU is sm_100"),
                         ({"capability": (8, 0)}, "this GPU is sm_80")):
        assert said in flex_attn.refusal(**{**OK, **change}), change


def test_the_cache_is_the_users_unless_given(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(env.FLEX_CACHE.name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert flex_attn.cache_dir() == tmp_path / "andrea" / "flex"
    monkeypatch.setenv(env.FLEX_CACHE.name, str(tmp_path / "c"))
    assert flex_attn.cache_dir() == tmp_path / "c"


def test_a_given_library_takes_the_run_time_libraries_beside_it(monkeypatch, tmp_path) -> None:
    lib = tmp_path / "flex.so"
    monkeypatch.setenv(env.FLEX_LIB.name, str(lib))
    with pytest.raises(RunError, match=r"ANDREA_FLEX_LIB=.*no such file"):
        flex_attn.library_paths()
    lib.write_bytes(b"")
    assert flex_attn.library_paths() == (lib, None, None)  # the manifest's paths then
    (tmp_path / "libtvm_ffi.so").write_bytes(b"")
    (tmp_path / "libcute_dsl_runtime.so").write_bytes(b"")
    assert flex_attn.library_paths() == (lib, str(tmp_path / "libtvm_ffi.so"),
                                         str(tmp_path / "libcute_dsl_runtime.so"))


def test_without_a_given_library_it_builds_in_the_cache(monkeypatch, tmp_path) -> None:
    from engine.backends.cuda import flex_build

    seen = {}

    def build(cache, *, python=None):
        seen.update(cache=cache, python=python)
        return tmp_path / "built.so", False

    monkeypatch.delenv(env.FLEX_LIB.name, raising=False)
    monkeypatch.setenv(env.FLEX_CACHE.name, str(tmp_path / "c"))
    monkeypatch.setenv(env.FLEX_PYTHON.name, "/opt/py312/bin/python")
    monkeypatch.setattr(flex_build, "build", build)
    monkeypatch.setattr(flex_attn, "_built", {})
    assert flex_attn.library_paths() == (tmp_path / "built.so", None, None)
    assert seen == {"cache": tmp_path / "c", "python": "/opt/py312/bin/python"}


S120 = ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449, seq_len=1024)


def test_the_memory_plan_holds_its_scratch_and_plan_arrays_in_their_own_group() -> None:
    """At ANDREA-120M's shape (B 8): the scratch flex_call sizes and the nine plan
    arrays (24.8 MiB), each 256-byte aligned, in a "flex" group that only a plan with them names."""
    plan = plan_memory(S120, 8, "bf16", "cudnn", True, 1 << 20, qkv_rows=True)[0]
    before = plan.totals()
    assert "flex" not in before
    flex_attn.plan_buffers(plan, 8, 1024, 12)
    after = plan.totals()
    sizes = [*scratch_bytes(8, 1024, 12).values()]
    sizes += [a.nbytes for _, a in causal_plan(8, 1024).arrays()]
    want = sum(-(-max(n, 1) // 256) * 256 for n in sizes)
    assert after["flex"] == want and after["total"] - before["total"] == want
    assert sum(scratch_bytes(8, 1024, 12).values()) == 25955328  # 24.75 MiB
    assert {k: v for k, v in after.items() if k not in ("flex", "total")} == \
        {k: v for k, v in before.items() if k != "total"}


class _FakeBackward:
    """FlexBackward's surface that FlexAttention uses, recording its calls."""

    def __init__(self, B: int = 2, T: int = 256, H: int = 3) -> None:
        self.B, self.T, self.H = B, T, H
        self.plan = causal_plan(B, T)
        self.set_plan_with: list[int] = []
        self.made: list[dict] = []
        self.ran: list[tuple[object, int]] = []

    def plan_arrays(self):
        return self.plan.arrays()

    def set_plan(self, pointers):
        self.set_plan_with = list(pointers)

    def make_args(self, **kw):
        self.made.append(kw)
        return ("args", len(self.made))

    def run(self, args, stream):
        self.ran.append((args, stream))


def _bound(fb: _FakeBackward) -> tuple[flex_attn.FlexAttention, dict]:
    plan = Plan()
    flex_attn.plan_buffers(plan, fb.B, fb.T, fb.H)
    base = {"flex": 1 << 32}
    plan._bases = base  # as allocate() would: one allocation for the group
    uploads = {}
    drv = SimpleNamespace(memcpy_htod=lambda ptr, a: uploads.__setitem__(ptr, a.copy()))
    fa = flex_attn.FlexAttention(fb, 0.125)
    fa.bind(plan, drv)
    return fa, {"plan": plan, "uploads": uploads}


def test_bind_uploads_the_plan_and_bwd_makes_the_arguments_once_per_buffers() -> None:
    fb = _FakeBackward()
    fa, got = _bound(fb)
    plan = got["plan"]
    assert fb.set_plan_with == [plan[f"flex.plan.{n}"] for n in FIELDS]
    for name, a in fb.plan_arrays():
        assert np.array_equal(got["uploads"][plan[f"flex.plan.{name}"]], a)
    ptrs = {"dout": 1 << 20, "qkv": 2 << 20, "out": 3 << 20, "stats": 4 << 20, "dqkv": 5 << 20}
    for _ in range(3):
        fa.bwd(**ptrs, B=2, T=256, stream=77)
    fa.bwd(**{**ptrs, "qkv": 6 << 20}, B=2, T=256, stream=77)  # another layer's buffers
    assert len(fb.made) == 2 and [s for _, s in fb.ran] == [77] * 4
    assert fb.made[0] == {"qkv": 2 << 20, "o": 3 << 20, "do": 1 << 20, "lse": 4 << 20,
                          "dqkv": 5 << 20, "lse2": plan["flex.lse2"],
                          "dpsum": plan["flex.dpsum"], "dq_accum": plan["flex.dq_accum"],
                          "dq_sem": plan["flex.dq_sem"], "scale": 0.125}
    with pytest.raises(RunError, match="planned for B=2 T=256, asked for B=2 T=128"):
        fa.bwd(**ptrs, B=2, T=128, stream=77)


@pytest.mark.parametrize(("fits", "rows"), [(True, True), (False, True), (True, False)])
def test_ops_runs_the_flex_backward_where_it_fits(fits, rows) -> None:
    calls = {"cudnn": [], "flex": []}
    cudnn = SimpleNamespace(rows=rows, bwd=lambda *a: calls["cudnn"].append(a))
    flex = SimpleNamespace(fits=lambda B, T: fits, bwd=lambda **kw: calls["flex"].append(kw))
    o = Ops({}, None, SimpleNamespace(handle=99), "bf16", cudnn=cudnn, cudnn_ws=4096)
    o.flex = flex
    o.attn_bwd_cudnn(7, 1 << 20, 8, 9, 1 << 24, 2, 256, 192, 0)
    if fits and rows:
        assert calls == {"cudnn": [], "flex": [{"dout": 7, "qkv": 1 << 20, "out": 8,
                                                "stats": 9, "dqkv": 1 << 24, "B": 2, "T": 256,
                                                "stream": 99}]}
    else:
        assert calls["flex"] == [] and len(calls["cudnn"]) == 1


def _choice(**over) -> AttentionChoice:
    """An AttentionChoice as `choose` leaves it with cuDNN's attention in rows, bf16, hd 64,
    T 256, on an sm_90 device, unless `over` says otherwise: what pick_flex reads."""
    shapes = ModelShapes(n_layer=1, d_model=over.pop("d_model", 192), n_head=3, d_ff=128,
                         vocab_size=64, seq_len=256)
    cap = over.pop("capability", (9, 0))
    gpu = SimpleNamespace(ordinal=0, dev=SimpleNamespace(compute_capability=lambda: cap))
    choice = AttentionChoice(shapes, 2, "bf16", over.pop("fusions", True), True, gpu, None, [])
    choice.attention, choice.qkv_rows = "cudnn", True
    choice.info = "cudnn (cuDNN 9; deterministic backward)"
    choice.cudnn = SimpleNamespace(version="cuDNN 9", scale=0.125)
    for k, v in over.items():
        setattr(choice, k, v)
    return choice


def test_a_build_is_tried_once_per_process(monkeypatch, tmp_path) -> None:
    """Every CudaBackend start asks for the library; the build (a subprocess probe at least)
    runs once per cache directory and interpreter, and a failure is not tried again."""
    from engine.backends.cuda import flex_build

    calls = []

    def build(cache, *, python=None):
        calls.append(cache)
        if "bad" in str(cache):
            raise RunError("flex attention build: the package nvidia-cutlass-dsl is not installed")
        return tmp_path / "built.so", True

    monkeypatch.delenv(env.FLEX_LIB.name, raising=False)
    monkeypatch.setattr(flex_build, "build", build)
    monkeypatch.setattr(flex_attn, "_built", {})
    monkeypatch.setattr(flex_attn, "build_notes", [])
    for cache in ("good", "bad"):
        monkeypatch.setenv(env.FLEX_CACHE.name, str(tmp_path / cache))
        for _ in range(3):
            if cache == "good":
                assert flex_attn.library_paths()[0] == tmp_path / "built.so"
            else:
                with pytest.raises(RunError, match="nvidia-cutlass-dsl is not installed"):
                    flex_attn.library_paths()
    assert calls == [tmp_path / "good", tmp_path / "bad"]
    assert len(flex_attn.build_notes) == 1  # the one compile, said once


def test_a_build_that_compiled_is_said_at_start(monkeypatch, tmp_path) -> None:
    """A compile (flex_build.build says so) is said in the notes of the backend that asked,
    even where its library then fails to load; a cache hit says nothing."""
    from engine.backends.cuda import flex_build

    compiles = [True, False]

    def build(cache, *, python=None):
        return tmp_path / "x.so", compiles.pop(0)

    monkeypatch.delenv(env.FLEX_LIB.name, raising=False)
    monkeypatch.setenv(env.FLEX_CACHE.name, str(tmp_path / "c"))
    monkeypatch.setattr(flex_attn, "_built", {})
    monkeypatch.setattr(flex_attn, "build_notes", [])
    monkeypatch.setattr(flex_build, "build", build)
    loads = []

    def load(lib, B, T, H, **kw):
        loads.append(lib)
        if len(loads) == 1:
            raise RunError("flex attention: cannot load libtvm_ffi.so")
        return _FakeBackward(B, T, H)

    monkeypatch.setattr(flex_attn, "FlexBackward", load)
    choice = _choice()
    assert choice.pick_flex() is None  # built, then its load failed: both said, to this start
    assert len(choice.notes) == 2
    assert choice.notes[0].startswith("gpu.flex_backward: flex attention: cannot load")
    assert choice.notes[1].startswith("the flex attention backward was built in ")
    assert str(tmp_path / "c") in choice.notes[1]
    choice = _choice()  # the next start in the process: nothing left over, loaded
    assert choice.pick_flex() is not None and choice.notes == []
    monkeypatch.setattr(flex_attn, "_built", {})  # a new process: the cache hit says nothing
    choice = _choice()
    assert choice.pick_flex() is not None and choice.notes == []


def test_where_it_can_run_it_runs_and_says_so(monkeypatch) -> None:
    opened = []

    def open_backward(B, T, H, device_id):
        opened.append((B, T, H, device_id))
        return _FakeBackward(B, T, H)

    monkeypatch.setattr(flex_attn, "open_backward", open_backward)
    choice = _choice()
    fa = choice.pick_flex()
    assert isinstance(fa, flex_attn.FlexAttention) and fa.scale == 0.125
    assert opened == [(2, 256, 3, 0)]  # the backward's one shape: the micro-batch, seq_len
    assert choice.notes == []
    assert choice.info == "cudnn (cuDNN 9; flex deterministic backward)"


@pytest.mark.parametrize(("over", "said"), [
    ({"attention": "classic"}, "gpu.flex_backward: needs cuDNN's attention, and the classic "
                               "attention runs; it is not used"),
    ({"qkv_rows": False, "want_qkv_rows": False},
     "gpu.flex_backward: needs Q, K, V in rows, and cuDNN runs them as slabs (gpu.qkv_rows is "
     "false); cuDNN's deterministic backward runs"),
    ({"qkv_rows": False, "want_qkv_rows": False, "fusions": False},
     "gpu.flex_backward: needs Q, K, V in rows, and cuDNN runs them as slabs (the rows are the "
     "fused path's, and gpu.fusions is false); cuDNN's deterministic backward runs"),
    ({"qkv_rows": False, "want_qkv_rows": False, "d_model": 46464 * 3},
     "gpu.flex_backward: needs Q, K, V in rows, and cuDNN runs them as slabs (d_model² ≥ 2³¹: "
     "the optimizer kernels' 32-bit division keeps the slabs); cuDNN's deterministic backward "
     "runs"),
    ({"qkv_rows": False},
     "gpu.flex_backward: needs Q, K, V in rows, and cuDNN runs them as slabs (cuDNN refuses "
     "them in rows: see the gpu.qkv_rows note); cuDNN's deterministic backward runs"),
    ({"d_model": 384}, "gpu.flex_backward: needs head dim 64 (d_model / n_head), the model has "
                       "128; cuDNN's deterministic backward runs"),
    ({"capability": (10, 0)}, "gpu.flex_backward: its kernels are sm_90a's (Hopper), this GPU "
                              "is sm_100; cuDNN's deterministic backward runs"),
    ({"capability": (8, 0)}, "gpu.flex_backward: its kernels are sm_90a's (Hopper), this GPU "
                             "is sm_80; cuDNN's deterministic backward runs"),
])
def test_refused_it_says_why(monkeypatch, over, said) -> None:
    monkeypatch.setattr(flex_attn, "open_backward", lambda *a: pytest.fail("not to be loaded"))
    choice = _choice(**over)
    assert choice.pick_flex() is None
    assert choice.notes == [said]


def test_a_library_that_does_not_load_falls_back_and_says_so(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(env.FLEX_LIB.name, str(tmp_path / "none.so"))
    choice = _choice()
    assert choice.pick_flex() is None
    assert choice.notes == [f"gpu.flex_backward: ANDREA_FLEX_LIB={tmp_path / 'none.so'}: no "
                            f"such file; cuDNN's deterministic backward runs"]
    assert "flex" not in choice.info


class _FailingBackward(_FakeBackward):
    """A backward whose call reports a failure (as flex_call.FlexBackward.run does with TVM
    FFI's message)."""

    def run(self, args, stream):
        super().run(args, stream)
        raise RunError("flex attention backward: CUDA error: no kernel image is available")


def _started(monkeypatch, fb: _FakeBackward) -> SimpleNamespace:
    """A choice at the point of start-up where the flex backward is bound (bind_flex):
    pick_flex done with `fb`, the plan allocated, Ops made without it. `bind()` binds it."""
    monkeypatch.setattr(flex_attn, "open_backward", lambda *a: fb)
    choice = _choice()
    choice.flex = choice.pick_flex()
    assert choice.flex is not None
    plan = Plan()
    flex_attn.plan_buffers(plan, fb.B, fb.T, fb.H)
    plan._bases = {"flex": 1 << 32}
    drv = SimpleNamespace(memcpy_htod=lambda ptr, a: None)
    synced = []
    choice.stream = SimpleNamespace(handle=55, synchronize=lambda: synced.append(len(fb.ran)))
    ops = SimpleNamespace(flex=None)
    layer0 = {"qkv": 2 << 20, "att": 3 << 20, "attn_stats": 4 << 20}
    named = {"datt": 1 << 20, "dqkv": 5 << 20}
    train = SimpleNamespace(at=named.__getitem__, layer=lambda l: layer0 if l == 0 else {})
    return SimpleNamespace(choice=choice, plan=plan, synced=synced, ops=ops,
                           bind=lambda: choice.bind_flex(plan, drv, ops, train))


def test_bound_its_first_call_runs_eagerly_on_layer_0_and_ops_then_runs_it(monkeypatch) -> None:
    fb = _FakeBackward()
    s = _started(monkeypatch, fb)
    choice, plan, synced = s.choice, s.plan, s.synced
    s.bind()
    assert s.ops.flex is choice.flex  # Ops runs it from here on
    assert fb.set_plan_with == [plan[f"flex.plan.{n}"] for n in FIELDS]
    assert len(fb.ran) == 1 and synced == [1]  # one eager call, waited for
    assert fb.made == [{"qkv": 2 << 20, "o": 3 << 20, "do": 1 << 20, "lse": 4 << 20,
                        "dqkv": 5 << 20, "lse2": plan["flex.lse2"], "dpsum": plan["flex.dpsum"],
                        "dq_accum": plan["flex.dq_accum"], "dq_sem": plan["flex.dq_sem"],
                        "scale": 0.125}]
    assert fb.ran[0][1] == 55  # on the backend's stream
    assert choice.notes == []
    assert "flex" in choice.info


def test_a_first_call_that_fails_falls_back_to_cudnn_and_says_so(monkeypatch) -> None:
    fb = _FailingBackward()
    s = _started(monkeypatch, fb)
    choice = s.choice
    s.bind()  # no exception: start-up goes on
    assert choice.flex is None and s.ops.flex is None
    assert choice.notes == ["gpu.flex_backward: its first call failed: flex attention backward: "
                            "CUDA error: no kernel image is available; cuDNN's deterministic "
                            "backward runs"]
    assert choice.info == "cudnn (cuDNN 9; deterministic backward)"


def test_a_first_call_that_faults_the_context_is_a_run_error_that_says_so(monkeypatch) -> None:
    """A fault seen only at the synchronize (pycuda's own error, the context lost): no fallback
    is possible, so start-up ends with a RunError naming the setting, not a pycuda traceback."""
    fb = _FakeBackward()
    s = _started(monkeypatch, fb)
    choice = s.choice

    class LaunchError(Exception):
        pass

    def synchronize():
        raise LaunchError("cuStreamSynchronize failed: an illegal memory access was encountered")

    choice.stream.synchronize = synchronize
    with pytest.raises(RunError, match=r"gpu.flex_backward: its first call faulted \(LaunchError: "
                                       r"cuStreamSynchronize failed: an illegal memory access"
                                       r".*the CUDA context is lost: start with "
                                       r"\"flex_backward\": false in the config's gpu section"):
        s.bind()
    assert len(fb.ran) == 1 and s.ops.flex is None


def test_a_bind_that_fails_falls_back_to_cudnn(monkeypatch) -> None:
    fb = _FakeBackward()
    s = _started(monkeypatch, fb)
    choice = s.choice

    def set_plan(pointers):
        raise RunError("flex attention: set_plan failed")

    fb.set_plan = set_plan
    s.bind()
    assert choice.flex is None and s.ops.flex is None and fb.ran == []
    assert choice.notes == ["gpu.flex_backward: its plan did not upload: flex attention: "
                            "set_plan failed; cuDNN's deterministic backward runs"]


def test_the_unpack_prints_an_export_that_a_shell_can_eval(tmp_path) -> None:
    """scripts/flex-pack --unpack on a pack in a folder with a space and a quote in its name:
    the runtime library restored from its .xz, and the printed line, eval'd as gpu-check does,
    sets ANDREA_FLEX_LIB to the library's path."""
    from engine.backends.cuda import flex_build

    pack = tmp_path / "a pack's $HOME"
    pack.mkdir()
    for name in ("flex_bwd.so", "libtvm_ffi.so"):
        (pack / name).write_bytes(b"x")
    manifest = {"entry_symbol": flex_build.ENTRY_SYMBOL, "recipe_sha256": flex_build.RECIPE_SHA256,
                "arg_names": list(flex_build.ARG_NAMES), "dtype": "bf16", "head_dim": 64,
                **flex_build.TESTED_VERSIONS}
    (pack / "flex_bwd.json").write_text(json.dumps(manifest))
    with lzma.open(pack / "libcute_dsl_runtime.so.xz", "wb") as f:
        f.write(b"runtime")
    script = Path(__file__).resolve().parents[1] / "scripts" / "flex-pack"
    env = {"PATH": "/usr/bin:/bin", "PACK": str(pack), "PYTHON": sys.executable}
    cmd = ["bash", "-c", f'e=$({script} --unpack) && eval "$e" && printf %s "$ANDREA_FLEX_LIB"']
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert out == str(pack / "flex_bwd.so")
    assert (pack / "libcute_dsl_runtime.so").read_bytes() == b"runtime"
    # a pack from another recipe: refused in one line (every backend would refuse it)
    (pack / "flex_bwd.json").write_text(json.dumps({**manifest, "recipe_sha256": "0" * 64}))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"flex-pack --unpack: flex attention: {pack / 'flex_bwd.so'} was built from another "
        f"flex_build_main.py (recipe {'0' * 16}, this checkout's "
        f"{flex_build.RECIPE_SHA256[:16]}): rebuild it"]


def test_a_pack_that_fails_to_build_is_one_line_and_keeps_the_old_pack(tmp_path) -> None:
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "flex_bwd.so").write_bytes(b"the old pack")
    script = Path(__file__).resolve().parents[1] / "scripts" / "flex-pack"
    env = {"PATH": "/usr/bin:/bin", "PACK": str(pack), "PYTHON": sys.executable,
           "ANDREA_FLEX_PYTHON": str(tmp_path / "no-python"), "HOME": str(tmp_path)}
    r = subprocess.run([str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"flex-pack: flex attention build: cannot run the interpreter "
        f"'{tmp_path / 'no-python'}' (FileNotFoundError: No such file or directory)"]
    assert not (tmp_path / ".pack.new").exists()
    assert (pack / "flex_bwd.so").read_bytes() == b"the old pack"
