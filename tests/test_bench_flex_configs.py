"""dev/bench_flex_configs.py and the config overrides behind it (flex_build_main.BWD_CONFIG,
dev/flex-variants) on the CPU: argument errors (one line on stderr, exit 2, no traceback),
the variants' listing, the run-time library's unpacking, and the plan adapted to a variant's
manifest. The timing and the kernels need an H200 (the script's docstring says what is not
verified here)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import lzma
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.cuda import flex_build
from engine.backends.cuda.flex_plan import causal_plan, diagonal_mask_words, fragment_coords

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "dev" / "bench_flex_configs.py"


def _load(name: str, path: Path):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    loader.exec_module(mod)
    return mod


bench = _load("bench_flex_configs", SCRIPT)


def _run(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)


def _refused(r: subprocess.CompletedProcess, match: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert match in lines[0], lines[0]
    assert r.stdout == ""


@pytest.mark.parametrize(("args", "match"), [
    (("--heads", "0"), "head counts must be >= 1"),
    (("--heads", "12,x"), "comma-separated list of head counts"),
    (("--heads", ""), "comma-separated list"),
    (("--batch", "0"), "--batch: must be >= 1"),
    (("--seq", "1000"), "multiple of 128"),
    (("--reps", "-3"), "--reps: must be >= 1"),
    (("--trials", "two"), "not an integer"),
    (("--timeout", "0"), "--timeout: must be >= 1"),
    (("--bogus",), "unrecognized arguments: --bogus"),
    (("--worker", "frontend"), "--worker needs --result"),
    (("--json", "/nonexistent-dir/out.json"), "--json /nonexistent-dir/out.json: cannot write"),
    (("--json", "/"), "--json /: cannot write a file there"),
])
def test_bad_arguments_are_one_line_and_exit_2(args: tuple[str, ...], match: str) -> None:
    _refused(_run(*args), match)


def test_help_exits_0() -> None:
    r = _run("--help")
    assert r.returncode == 0 and "--variants" in r.stdout


def _variants(tmp_path: Path, rows: list[dict], built: tuple[str, ...] = ()) -> Path:
    vdir = tmp_path / "pack" / "variants"
    vdir.mkdir(parents=True)
    (vdir / "index.json").write_text(json.dumps({"variants": rows}))
    for name in built:
        (vdir / f"{name}.so").write_bytes(b"\x7fELF")
        (vdir / f"{name}.json").write_text(json.dumps({"variant": name, "overrides": {}}))
    return vdir


def test_a_missing_or_empty_variants_folder_is_refused(tmp_path: Path) -> None:
    _refused(_run("--variants", str(tmp_path / "none")), "no variants folder")
    (tmp_path / "empty").mkdir()
    _refused(_run("--variants", str(tmp_path / "empty")), "no built variants")
    vdir = _variants(tmp_path, [{"name": "frontend", "ok": False, "error": "x"}])
    _refused(_run("--variants", str(vdir)), "no built variants")
    (vdir / "index.json").write_text("{not json")
    _refused(_run("--variants", str(vdir)), "is not a variants index")


def _gpu_present() -> bool:
    try:
        import pycuda.driver as drv

        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


def test_no_gpu_is_one_line_and_exit_2_and_unpacks_nothing(tmp_path: Path) -> None:
    if _gpu_present():
        pytest.skip("a GPU is present: the script would run")
    vdir = _variants(tmp_path, [{"name": "frontend", "ok": True}], built=("frontend",))
    (vdir.parent / "libtvm_ffi.so").write_bytes(b"x")
    with lzma.open(vdir.parent / "libcute_dsl_runtime.so.xz", "wb") as f:
        f.write(b"runtime")
    _refused(_run("--variants", str(vdir)), "no GPU")
    assert not (vdir.parent / "libcute_dsl_runtime.so").exists()
    _refused(_run("--variants", str(vdir), "--only", "other"), "--only names variants not built")


def test_variants_are_listed_frontend_first_with_the_failed_ones(tmp_path: Path) -> None:
    rows = [{"name": "pds1", "ok": True}, {"name": "mdq1", "ok": False, "error": "M-mode"},
            {"name": "frontend", "ok": True}, {"name": "gone", "ok": True}]
    vdir = _variants(tmp_path, rows, built=("pds1", "frontend"))
    built, failed = bench.list_variants(vdir)
    assert [v["name"] for v in built] == ["frontend", "pds1"]
    assert [(v["name"], v["error"]) for v in failed] == [
        ("mdq1", "M-mode"), ("gone", "gone.so or gone.json missing")]
    built, _ = bench.list_variants(vdir, "pds1")
    assert [v["name"] for v in built] == ["pds1"]


def test_the_runtime_library_is_unpacked_beside_the_pack(tmp_path: Path) -> None:
    with pytest.raises(bench.Refused, match=r"libtvm_ffi\.so is missing"):
        bench.runtime_libs(tmp_path)
    (tmp_path / "libtvm_ffi.so").write_bytes(b"x")
    with pytest.raises(bench.Refused, match="neither"):
        bench.runtime_libs(tmp_path)
    payload = bytes(range(256)) * 1000
    with lzma.open(tmp_path / "libcute_dsl_runtime.so.xz", "wb") as f:
        f.write(payload)
    tvm, runtime = bench.runtime_libs(tmp_path)
    assert Path(runtime).read_bytes() == payload and Path(tvm).name == "libtvm_ffi.so"
    assert bench.runtime_libs(tmp_path) == (tvm, runtime)  # unpacked once


# ---- the plan for a variant ------------------------------------------------------------------
def _manifest(**cfg: object) -> dict:
    return {"bwd_config": {**flex_build.BWD_CONFIG, **cfg},
            "plan_mask_words": diagonal_mask_words(*fragment_coords()).tolist()}


@pytest.mark.parametrize(("B", "T"), [(8, 1024), (2, 384), (3, 128)])
def test_the_frontend_config_keeps_the_plan(B: int, T: int) -> None:
    arrays = causal_plan(B, T).arrays()
    got, notes = bench.variant_plan(arrays, _manifest())
    assert notes == [] and [n for n, _ in got] == [n for n, _ in arrays]
    for (_, a), (_, b) in zip(arrays, got, strict=True):
        assert a is b
    got, notes = bench.variant_plan(arrays, {})  # an older manifest: the plan as it is
    assert notes == []


@pytest.mark.parametrize("cfg", [{"spt": False}, {"deterministic": False}])
@pytest.mark.parametrize(("B", "T"), [(8, 1024), (2, 384), (3, 128)])
def test_without_spt_the_dq_ranks_count_the_earlier_key_blocks(B: int, T: int, cfg: dict) -> None:
    """The frontend's planner without spt: a block's rank is the number of key blocks n' < n
    that also reach query block m (plan/kernels/common.py:283-302), here from the dense mask."""
    p = causal_plan(B, T)
    got, notes = bench.variant_plan(p.arrays(), _manifest(**cfg))
    assert notes == ["dQ ranks without spt"]
    g = dict(got)
    nb = T // 128
    visible = np.arange(T)[:, None] <= np.arange(T)[None, :]  # [key, query]
    some = visible.reshape(nb, 128, nb, 128).any(axis=(1, 3))  # [n, m]
    want_order, want_forder = [], []
    for r in range(B * nb):
        n = r % nb
        for m in p.idx[p.off[r]:p.off[r + 1]]:
            want_order.append(sum(some[k, m] for k in range(n)))
        for m in p.fidx[p.foff[r]:p.foff[r + 1]]:
            want_forder.append(sum(some[k, m] for k in range(n)))
    assert g["order"].tolist() == want_order and g["forder"].tolist() == want_forder
    assert g["order"].dtype == g["forder"].dtype == np.int32
    for name in ("cnt", "idx", "fcnt", "fidx", "off", "foff", "masks"):
        assert g[name] is dict(p.arrays())[name]


def test_the_masks_come_from_the_manifest_where_they_differ() -> None:
    p = causal_plan(2, 256)
    key, query = fragment_coords()
    words = diagonal_mask_words(query, key)  # another layout: other words
    m = {"bwd_config": {**flex_build.BWD_CONFIG, "SdP_swapAB": False},
         "plan_mask_words": words.tolist()}
    got, notes = bench.variant_plan(p.arrays(), m)
    masks = dict(got)["masks"]
    assert notes == ["masks from the manifest"]
    assert masks.shape == p.masks.shape and masks.dtype == np.uint32
    assert masks.flags.c_contiguous and (masks == words[None, None]).all()
    with pytest.raises(ValueError, match="plan_mask_words has shape"):
        bench.variant_plan(p.arrays(), {"plan_mask_words": [[1, 2, 3]]})


def test_compare_reports_each_gradient() -> None:
    rng = np.random.default_rng(0)
    d = 128
    ref = bench.bf16_bits(rng.standard_normal((256, 3 * d), dtype=np.float32))
    same = bench.compare(ref, ref, d)
    assert same["rel"] == 0.0 and same["max_abs"] == 0.0
    got = ref.copy()
    got[:, d:2 * d] = bench.bf16_bits(2 * bench.bf16_float(ref[:, d:2 * d]))  # dK doubled
    c = bench.compare(got, ref, d)
    assert c["dQ"]["rel"] == c["dV"]["rel"] == 0.0 and c["dK"]["rel"] == pytest.approx(1.0)
    got[0, 0] = 0x7FC0  # NaN in dQ
    assert bench.compare(got, ref, d)["dQ"]["rel"] == float("inf")


# ---- the build side: BWD_CONFIG overrides, flex-variants ------------------------------------
main_script = _load("flex_build_main_for_tests", flex_build.BUILD_SCRIPT)


def test_bwd_config_is_the_frontends_and_the_postprocess_follows_it() -> None:
    assert flex_build.BWD_CONFIG == main_script.BWD_CONFIG == {
        "deterministic": True, "spt": True, "tile_m": 128, "tile_n": 128, "Q_stage": 2,
        "dO_stage": 2, "PdS_stage": 2, "SdP_swapAB": True, "dKV_swapAB": False,
        "AtomLayoutNdKV": 2, "AtomLayoutMdQ": 2, "dQ_single_wg": False, "dQ_swapAB": False}
    # FlexAttentionBackwardPostprocess(dt, 64, 90, 128, 256, 2, False, False) today
    assert main_script.kernel_args(main_script.bwd_config()) == {
        "pre_tile_m": 128, "post_tile_m": 128, "post_num_threads": 256, "post_atom_layout": 2,
        "post_swap_ab": False, "post_accum_row_major": False}
    k = main_script.kernel_args(main_script.bwd_config(
        {"dQ_single_wg": True, "AtomLayoutMdQ": 1, "dQ_swapAB": True}))
    assert (k["post_num_threads"], k["post_atom_layout"], k["post_swap_ab"]) == (128, 1, True)


@pytest.mark.parametrize(("overrides", "match"), [
    ('{"tile_m": 64}', "tile_m is fixed to 128"),
    ('{"tile_n": 256}', "tile_n is fixed to 128"),
    ('{"Q_stages": 1}', "unknown BWD_CONFIG keys ['Q_stages']"),
    ('{"spt": 0}', "BWD_CONFIG['spt'] takes bool, got int 0"),
    ('{"Q_stage": true}', "BWD_CONFIG['Q_stage'] takes int, got bool True"),
    ('{"Q_stage": 1.0}', "takes int, got float"),
    ("[1]", "OVERRIDES must be a JSON object"),
    ("{oops", "OVERRIDES is not JSON"),
])
def test_bad_overrides_are_the_build_scripts_error(overrides: str, match: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    """Refused before anything is imported or compiled (no DSL needed): exit 3, one JSON line."""
    rc = main_script.main(["compile", "/nonexistent/x.o", "n", "64", "bf16", overrides])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 3 and len(out) == 1
    assert match in json.loads(out[0])["error"]


def test_build_variant_refuses_a_bad_name(tmp_path: Path) -> None:
    from engine.errors import RunError

    for name in ("", "../x", ".hidden", "a b", "x" * 65):
        with pytest.raises(RunError, match="is not"):
            flex_build.build_variant(tmp_path, name, {}, info={})
    assert list(tmp_path.iterdir()) == []


def test_flex_variants_lists_and_refuses_unknown_names() -> None:
    script = ROOT / "dev" / "flex-variants"
    r = _run("--list", script=script)
    assert r.returncode == 0 and r.stdout.splitlines()[0].split() == ["frontend", "(none)"]
    fv = _load("flex_variants", script)
    assert next(iter(fv.VARIANTS)) == "frontend" and fv.VARIANTS["frontend"] == {}
    for overrides in fv.VARIANTS.values():
        main_script.bwd_config(overrides)  # every key known, every type right
    r = _run("nope", script=script)
    assert r.returncode == 2 and "unknown variants ['nope']" in r.stderr


# ---- the worker's flow on fake CUDA objects --------------------------------------------------
class _Alloc:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __int__(self) -> int:
        return self.ptr

    def free(self) -> None:
        pass


class FakeDrv:
    """Device memory as one bytearray (pointers are offsets into it, interior ones too)."""

    def __init__(self) -> None:
        self.mem = bytearray(1 << 24)
        self.top = 256

    def mem_alloc(self, n: int) -> _Alloc:
        p, self.top = self.top, self.top + (n + 255) // 256 * 256
        assert self.top <= len(self.mem)
        return _Alloc(p)

    def view(self, ptr: int, dtype: type, count: int) -> np.ndarray:
        return np.frombuffer(self.mem, dtype, count, int(ptr))

    def memcpy_htod(self, ptr: int, a: np.ndarray) -> None:
        b = np.ascontiguousarray(a).tobytes()
        self.mem[int(ptr):int(ptr) + len(b)] = b

    def memcpy_dtoh(self, a: np.ndarray, ptr: int) -> None:
        a[...] = self.view(ptr, a.dtype, a.size).reshape(a.shape)

    def memset_d16(self, ptr: int, value: int, count: int) -> None:
        self.view(ptr, np.uint16, count)[:] = value

    class Context:
        @staticmethod
        def synchronize() -> None:
            pass

    class Event:
        def record(self, stream: object) -> None:
            self.at = stream.calls

        def synchronize(self) -> None:
            pass

        def time_since(self, other: FakeDrv.Event) -> float:
            return 0.001 * (self.at - other.at)  # 1 µs a call


class FakeStream:
    handle = 0x1234
    calls = 0

    def synchronize(self) -> None:
        pass


class FakeGpu:
    def __init__(self) -> None:
        self.drv, self.stream, self.ordinal = FakeDrv(), FakeStream(), 0

    def describe(self, precision: str) -> str:
        return f"fake GPU ({precision})"


def _pattern(gpu: FakeGpu, dst: int, R: int, d: int, bump: int) -> None:
    """What the fakes 'compute' into [R, 3d] bf16 rows: 1.0 + a small step per column."""
    cols = bench.bf16_bits(1.0 + np.arange(3 * d, dtype=np.float32) / 1024)
    rows = np.broadcast_to(cols, (R, 3 * d)).copy()
    rows[0, 0] += bump
    gpu.drv.view(dst, np.uint16, R * 3 * d)[:] = rows.ravel()
    gpu.stream.calls += 1


def _fakes(monkeypatch: pytest.MonkeyPatch, gpu: FakeGpu, B: int, T: int) -> list:
    from engine.backends.cuda import cudnn_attn, flex_call, graphs

    made: list = []

    class FakeCudnn:
        version = "fake cuDNN"

        def __init__(self, precision, H, hd, stream, rows=False) -> None:
            assert rows and precision == "bf16" and hd == 64
            self.H, self.scale = H, 0.125

        def build(self, b, t, backward) -> int:
            assert (b, t, backward) == (B, T, True)
            return 0

        def workspace_bytes(self, b, t) -> int:
            return 0

        def fwd(self, q, k, v, o, stats, b, t, ws) -> None:
            gpu.drv.view(o, np.uint16, b * t * self.H * 64)[:] = 0x3F80

        def bwd(self, q, k, v, o, do, stats, dq, dk, dv, b, t, ws) -> None:
            d = self.H * 64
            assert (dk - dq, dv - dq) == (2 * d, 4 * d)  # bytes: K and V d elements apart
            _pattern(gpu, dq, b * t, d, 0)

        def close(self) -> None:
            pass

    class FakeFlex:
        def __init__(self, library, b, t, H, *, tvm_ffi_lib, cute_runtime_lib, device_id,
                     variant_ok) -> None:
            assert variant_ok  # the bench adapts each variant's plan, so it may load one
            self.b, self.t, self.H, self.plan = b, t, H, causal_plan(b, t)
            made.append(self)

        def plan_arrays(self):
            return self.plan.arrays()

        def set_plan(self, pointers) -> None:
            self.pointers = list(pointers)

        def scratch_bytes(self):
            return flex_call.scratch_bytes(self.b, self.t, self.H)

        def make_args(self, **kw):
            return kw

        def run(self, args, stream) -> None:
            assert stream == gpu.stream.handle and args["scale"] == 0.125
            _pattern(gpu, args["dqkv"], self.b * self.t, self.H * 64, 1)  # one ulp off

    class FakeGraph:
        def __init__(self, issue) -> None:
            self.launch = issue

        def node_counts(self):
            return {"kernel": 3, "memset": 1}

        def close(self) -> None:
            pass

    monkeypatch.setattr(cudnn_attn, "CudnnAttention", FakeCudnn)
    monkeypatch.setattr(flex_call, "FlexBackward", FakeFlex)
    monkeypatch.setattr(graphs, "capture", lambda stream, issue: FakeGraph(issue))
    return made


def test_the_worker_and_the_tables_on_fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    """The worker's whole flow (reference, hand-off, variant load with its plan, two calls,
    comparisons, eager and graph timing, the result file) and the parent's table, with fake
    pycuda, cuDNN, FlexBackward and graphs: what the GPU run will go through, less the GPU."""
    from engine.backends.cuda import runtime

    gpu = FakeGpu()
    made = _fakes(monkeypatch, gpu, 1, 256)
    monkeypatch.setattr(runtime.Gpu, "get", classmethod(lambda cls: gpu))
    rows = [{"name": "frontend", "ok": True}, {"name": "spt_off", "ok": True}]
    vdir = _variants(tmp_path, rows, built=("frontend", "spt_off"))
    (vdir / "spt_off.json").write_text(json.dumps(_manifest(spt=False)))
    (vdir.parent / "libtvm_ffi.so").write_bytes(b"x")
    (vdir.parent / "libcute_dsl_runtime.so").write_bytes(b"x")
    results = {}
    for name in ("cudnn", "frontend", "spt_off"):
        path = tmp_path / f"{name}.json"
        a = bench.parse_args(["--worker", name, "--result", str(path), "--variants", str(vdir),
                              "--refdir", str(tmp_path / "ref"), "--heads", "2,1", "--batch", "1",
                              "--seq", "256", "--reps", "4", "--trials", "3"])
        assert bench.worker(a) == 0
        results[name] = json.loads(path.read_text())
    assert sorted(p.name for p in (tmp_path / "ref").iterdir()) == ["H1-B1-T256-s1234",
                                                                     "H2-B1-T256-s1234"]
    for name, res in results.items():
        assert res["device"] == "fake GPU (bf16)"
        for H in ("2", "1"):
            r = res["heads"][H]
            assert "error" not in r, r
            assert r["eager"]["us"] == pytest.approx(1.0) and r["graph"]["us"] == pytest.approx(1.0)
            assert r["same_bits_twice"] and r["graph_same_bits"]
            assert r["reference"] == ("computed here" if name == "cudnn" else "the cuDNN process's")
            assert r["vs_cudnn"]["rel"] == 0.0 if name == "cudnn" else r["vs_cudnn"]["rel"] > 0
    assert results["spt_off"]["heads"]["2"]["plan_notes"] == ["dQ ranks without spt"]
    assert results["frontend"]["heads"]["2"]["plan_notes"] == []
    assert {r["heads"]["1"]["cudnn_sha"] for r in results.values()} == {
        results["cudnn"]["heads"]["1"]["cudnn_sha"]}
    flex = made[-1]  # spt_off's last H: the plan it was given, ranks n, nothing null but empties
    assert len(flex.pointers) == 9 and all(p for p in flex.pointers[:4])
    lines = bench.table(2, {n: r["heads"]["2"] for n, r in results.items()})
    text = "\n".join(lines)
    assert "spt_off" in text and "1.000x" in text and "dQ ranks without spt" in text
    assert "WRONG" not in text

    # the parent, its workers' results given (run_worker runs this script in a subprocess)
    rows.append({"name": "mdq1", "ok": False, "error": "expects the M-mode to be 64"})
    (vdir / "index.json").write_text(json.dumps({"variants": rows}))
    monkeypatch.setattr(bench, "check_gpu", lambda: "fake GPU")
    monkeypatch.setattr(bench, "run_worker", lambda a, name, tmp: {**results[name], "wall_s": 1})
    capsys.readouterr()
    out_json = tmp_path / "bench.json"
    assert bench.main(["--variants", str(vdir), "--heads", "2,1", "--batch", "1", "--seq", "256",
                       "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "H=2: µs per call" in printed and "H=1: µs per call" in printed
    assert "mdq1: expects the M-mode to be 64" in printed and "WARNING" not in printed
    saved = json.loads(out_json.read_text())
    assert list(saved["results"]) == ["cudnn", "frontend", "spt_off"]
    assert saved["not_built"][0]["name"] == "mdq1" and saved["args"]["heads"] == [2, 1]


def test_a_failing_first_call_fails_its_row_only(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends.cuda import flex_call
    from engine.errors import RunError

    gpu = FakeGpu()
    _fakes(monkeypatch, gpu, 1, 128)

    def boom(self, args, stream) -> None:
        raise RunError("flex attention backward failed: RuntimeError: no kernel image")

    monkeypatch.setattr(flex_call.FlexBackward, "run", boom)
    a = bench.parse_args(["--heads", "1", "--batch", "1", "--seq", "128", "--reps", "1",
                          "--trials", "1"])
    variant = {"name": "x", "library": "x.so", "manifest": {}}
    r = bench.worker_one(a, 1, gpu, variant, ("a", "b"))
    assert r["error"].startswith("failed (first call): RunError: flex attention backward failed")
    assert "eager" not in r
    line = bench.table(1, {"x": r})[-1]
    assert "failed (first call)" in line


def test_run_worker_starts_the_worker_and_reports_its_failure(tmp_path: Path) -> None:
    """The parent's command line for a worker parses, and a worker whose set-up fails (here:
    no pycuda or no GPU) fails each H of its row with the reason, without a traceback."""
    if _gpu_present():
        pytest.skip("a GPU is present: the worker would run")
    vdir = _variants(tmp_path, [{"name": "frontend", "ok": True}], built=("frontend",))
    (vdir.parent / "libtvm_ffi.so").write_bytes(b"x")
    (vdir.parent / "libcute_dsl_runtime.so").write_bytes(b"x")
    a = bench.parse_args(["--variants", str(vdir), "--heads", "2,1", "--timeout", "60"])
    (tmp_path / "w").mkdir()
    res = bench.run_worker(a, "frontend", tmp_path / "w")
    assert res["process_error"].startswith("exit 1")
    assert set(res["heads"]) == {"2", "1"}
    for r in res["heads"].values():
        assert r["error"].startswith("failed: ") and "Traceback" not in r["error"]
        assert "pycuda" in r["error"] or "CUDA" in r["error"] or "libcuda" in r["error"], r
