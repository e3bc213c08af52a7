"""The GPU benchmark's plan, on the CPU (dev/bench_gpu.py, run by `make gpu-check`, and its
modules): its models are the shipped configs' (bench_models.py), the memory estimates it groups
the implementations by and the groups (bench_groups.py), a whole model's run through them on
fakes (what is built, kept, closed and timed), the profile's split of kernel time by kind
(gpu_profile.py), and its command line's refusals. The times themselves are the benchmark's,
never a test's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.conftest import ROOT, dev_module

GIB = 2**30


def _bench():
    """The benchmark's run, command line and report."""
    return dev_module("bench_gpu")


def _models():
    """The models, their FLOPs and the engine's paths."""
    return dev_module("bench_models")


def _groups():
    """The memory estimates and the groups."""
    return dev_module("bench_groups")


def _profile():
    """The per-kernel profile and its split."""
    return dev_module("gpu_profile")


# --- the models and their sizes ---------------------------------------------------------------


@pytest.mark.parametrize(("key", "params"), [("120M", 92_248_320), ("312M", 311_790_592),
                                             ("1.2B", 1_227_560_960)])
def test_the_models_are_the_shipped_configs(key, params):
    import json

    from engine.model.layout import n_params

    m = _models()
    model = json.loads((ROOT / "experiments" / f"ANDREA-{key}-TRAIN.json").read_text())["model"]
    s = m.MODELS[key]
    assert {f: getattr(s, f) for f in model} == model
    assert n_params(s) == params
    assert set(m.MODELS) == {"120M", "12M", "312M", "1.2B"}


def test_gemm_flops_counts_the_six_gemms_of_a_layer_and_the_lm_head_three_times():
    from engine.model.layout import ModelShapes

    m = _models()
    s = ModelShapes(n_layer=2, d_model=4, n_head=2, d_ff=8, vocab_size=10, seq_len=3)
    rows = 5 * 3
    forward = 2 * rows * (2 * (4 * 16 + 2 * 4 * 8) + 4 * 10)
    assert m.gemm_flops(s, 5) == 3 * forward
    # ANDREA-120M's step: 4.49 TFLOP of GEMMs (docs/gpu.md)
    assert m.gemm_flops(m.MODELS["120M"]) == pytest.approx(4.4936e12, rel=1e-4)


def test_the_engine_estimate_is_the_memory_plan_of_each_path():
    from engine.backends.cuda.buffers import plan_memory

    g, m = _groups(), _models()
    s = m.MODELS["120M"]
    classic = plan_memory(s, 8, "bf16", "classic", False)[0].totals()["total"]
    assert g.engine_bytes(s, m.CLASSIC) == classic  # 7.43 GiB (docs/gpu.md)
    big = m.MODELS["1.2B"]
    fused, fp8 = g.engine_bytes(big, m.FUSED), g.engine_bytes(big, m.FP8)
    # the config's description: the bf16 plan is 37.3 GiB (with the flex backward's workspace,
    # smaller than the cuDNN backward's the estimate counts)
    assert 37.2 * GIB < fused < 38.0 * GIB
    assert fused < fp8 < g.engine_bytes(big, m.CLASSIC)
    assert g.engine_bytes(big, m.FUSED, {"logits_low_precision": False}) > fused


def test_the_torch_estimate_adds_parameters_activations_and_logits():
    from engine.model.layout import ModelShapes, n_params

    g = _groups()
    s = ModelShapes(n_layer=2, d_model=8, n_head=2, d_ff=32, vocab_size=10, seq_len=4)
    rows = 3 * 4
    want = 18 * n_params(s) + 2 * rows * (24 * 8 + 4 * 32) + 10 * rows * 10
    assert g.torch_bytes(s, 3) == int(1.1 * want)
    assert 38 * GIB < g.torch_bytes(_models().MODELS["1.2B"]) < 45 * GIB


# --- the groups -----------------------------------------------------------------------------------

NAMES = ["andrea", "andrea classic", "andrea fp8", "torch eager", "torch compile",
         "torch reduce-overhead", "torch reduce-overhead-cudnn"]


def sizes(fused: float, classic: float, fp8: float, torch: float) -> dict[str, float]:
    by = {"andrea": fused, "andrea classic": classic, "andrea fp8": fp8}
    return {n: by.get(n, torch) * GIB for n in NAMES}


def test_everything_in_one_group_where_it_fits():
    g = _groups()
    small = sizes(4.9, 7.4, 5.3, 5.5)  # ANDREA-120M: 44 GiB in all
    assert g.groups(NAMES, small, 80 * GIB) == [NAMES]
    assert g.groups(NAMES, sizes(40, 50, 40, 40), 80 * GIB, "all") == [NAMES]
    assert g.groups(["andrea"], {"andrea": 100 * GIB}, 80 * GIB) == [["andrea"]]


def test_pairs_hold_the_fused_path_and_one_other_the_fastest_pytorch_mode_first():
    g = _groups()
    got = g.groups(NAMES, sizes(4.9, 7.4, 5.3, 5.5), 140 * GIB, "pairs")
    assert got == [["andrea", "andrea classic"], ["andrea", "andrea fp8"],
                   ["andrea", "torch reduce-overhead"], ["andrea", "torch reduce-overhead-cudnn"],
                   ["andrea", "torch compile"], ["andrea", "torch eager"]]
    with pytest.raises(ValueError, match="expected one of auto, all, pairs"):
        g.groups(NAMES, sizes(1, 1, 1, 1), 140 * GIB, "two")


def test_auto_at_1_2b_on_an_h200_packs_the_engine_paths_and_pairs_each_pytorch_mode():
    """140 GiB free, 124 to spend (fits): the fused and classic paths fit together (86.8),
    fp8 does not fit beside them (125.9) and gets a group with the fused path alone."""
    g = _groups()
    got = g.groups(NAMES, sizes(37.8, 49.0, 39.1, 39.9), 140 * GIB)
    assert got == [["andrea", "andrea classic"], ["andrea", "andrea fp8"],
                   ["andrea", "torch reduce-overhead"], ["andrea", "torch reduce-overhead-cudnn"],
                   ["andrea", "torch compile"], ["andrea", "torch eager"]]
    assert g.fits(86.8 * GIB, 140 * GIB) and not g.fits(125.9 * GIB, 140 * GIB)


def test_auto_times_alone_what_does_not_fit_beside_the_fused_path():
    """An H100 at 1.2B: 79 GiB free, 69 to spend; nothing fits beside the fused path's 37.8."""
    g = _groups()
    got = g.groups(NAMES, sizes(37.8, 49.0, 39.1, 39.9), 79 * GIB)
    assert got == [["andrea"], ["andrea classic"], ["andrea fp8"], ["torch reduce-overhead"],
                   ["torch reduce-overhead-cudnn"], ["torch compile"], ["torch eager"]]
    # where a PyTorch mode fits beside it, the fused path needs no group of its own
    mixed = g.groups(["andrea", "andrea classic", "torch eager"],
                     {"andrea": 30 * GIB, "andrea classic": 60 * GIB, "torch eager": 30 * GIB},
                     79 * GIB)
    assert mixed == [["andrea classic"], ["andrea", "torch eager"]]


def test_the_grouping_line_says_what_ran():
    g = _groups()
    est = sizes(37.8, 49.0, 39.1, 39.9)
    plan = g.groups(NAMES, est, 140 * GIB)
    line = g.grouping_line("auto", plan, est, 140 * GIB)
    assert line.startswith("--groups auto: 6 groups, one after the other (estimated 285.5 GiB")
    assert "andrea + andrea classic | andrea + andrea fp8 | andrea + torch reduce-overhead" in line
    assert "one group" in g.grouping_line("all", [NAMES], est, 140 * GIB)


# --- one model through its groups, on fakes ---------------------------------------------------


class FakeBackend:
    fused_step = True

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def close(self) -> None:
        self.log.append(f"close {self.name}")

    def memory_plan(self) -> dict[str, int]:
        return {"total": GIB}


@pytest.fixture
def fake_bench(monkeypatch):
    """bench_gpu with every device call replaced (the names it imports from its modules, where
    it calls them): builds, closes and rounds go to `log`."""
    b, m = _bench(), _models()
    log: list[str] = []
    clock = b.Clock(lambda: None, lambda a, e: 0.0, lambda: None)

    def backend(s: Any, opts: dict[str, Any], graphs: bool = True,
                switched: dict[str, Any] | None = None) -> FakeBackend:
        name = {id(m.FUSED): "andrea", id(m.CLASSIC): "andrea classic",
                id(m.FP8): "andrea fp8"}[id(opts)]
        log.append(f"build {name}")
        return FakeBackend(name, log)

    def torch_step(s: Any, variant: str) -> tuple[Any, Any]:
        log.append(f"build torch {variant}")
        return (lambda tok, t: None), variant

    def timed_round(name: str, *args: Any) -> float:
        log.append(f"round {name}")
        return {"andrea": 0.010}.get(name, 0.020)

    monkeypatch.setattr(b, "andrea_backend", backend)
    monkeypatch.setattr(b, "andrea_step", lambda bk: (lambda tok, t, *nxt: None))
    monkeypatch.setattr(b, "andrea_clock", lambda bk: clock)
    monkeypatch.setattr(b, "torch_step", torch_step)
    monkeypatch.setattr(b, "torch_clock", lambda: clock)
    monkeypatch.setattr(b, "timed_round", timed_round)
    monkeypatch.setattr(b, "backend_notes", lambda bk, toks, t0: {"of": bk.name})
    monkeypatch.setattr(b, "batches", lambda s, n=4: [np.zeros((1, 2), np.int32)])
    monkeypatch.setattr(b, "free_memory", lambda: 79 * GIB)
    monkeypatch.setattr(b, "release_torch", lambda reset_compiled=True: log.append("release"))
    monkeypatch.setattr(b, "reset_torch_peak", lambda: None)
    monkeypatch.setattr(b.ModelBench, "torch_peak", lambda self, names: None)
    return b, log


def test_a_model_runs_group_by_group_keeping_the_fused_path_built(fake_bench, monkeypatch):
    b, log = fake_bench
    m = _models()
    # 1.2B-like on 79 GiB: classic alone, each PyTorch mode beside the fused path
    monkeypatch.setattr(b, "engine_bytes", lambda s, opts, switched=None: {
        id(m.FUSED): 30 * GIB, id(m.CLASSIC): 60 * GIB}[id(opts)])
    monkeypatch.setattr(b, "torch_bytes", lambda s: 30 * GIB)
    notes: dict[str, Any] = {}
    rows = b.bench_model("1.2B", ["eager", "reduce-overhead"], steps=2, rounds=2, notes=notes)
    assert notes["1.2B"]["grouping"]["groups"] == [
        ["andrea classic"], ["andrea", "torch reduce-overhead"], ["andrea", "torch eager"]]
    assert [x for x in log if x != "release"] == [
        "build andrea classic", "round andrea classic", "round andrea classic",
        "close andrea classic",
        "build andrea", "build torch reduce-overhead",
        "round andrea", "round torch reduce-overhead", "round andrea",
        "round torch reduce-overhead",
        "build torch eager",  # the fused path stays built: the next group holds it too
        "round andrea", "round torch eager", "round andrea", "round torch eager",
        "close andrea"]
    by = {r["impl"]: r for r in rows}
    assert [r["impl"] for r in rows] == ["andrea", "andrea classic", "torch eager",
                                         "torch reduce-overhead"]
    assert len(by["andrea"]["rounds_ms"]) == 4 and by["andrea"]["ms"] == pytest.approx(10.0)
    assert "rounds of 2 groups" in by["andrea"]["note"]
    assert "timed alone (no room beside andrea)" in by["andrea classic"]["note"]
    assert by["torch eager"]["vs_andrea"] == pytest.approx(2.0)
    assert "compile+3 steps" in by["torch reduce-overhead"]["note"]
    assert notes["1.2B"]["andrea"] == {"of": "andrea"}
    assert notes["1.2B"]["grouping"]["plan_gib"] == {"andrea classic": 1.0, "andrea": 1.0}


def test_an_implementation_that_fails_is_reported_and_the_others_go_on(fake_bench, monkeypatch):
    b, log = fake_bench
    monkeypatch.setattr(b, "engine_bytes", lambda s, opts, switched=None: GIB)
    monkeypatch.setattr(b, "torch_bytes", lambda s: GIB)

    def broken(s: Any, variant: str) -> Any:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(b, "torch_step", broken)
    notes: dict[str, Any] = {}
    rows = b.bench_model("12M", ["compile"], steps=2, rounds=1, notes=notes, paths=("fused",),
                         grouping="all")
    by = {r["impl"]: r for r in rows}
    assert by["torch compile"]["note"] == "failed: RuntimeError: CUDA out of memory"
    assert by["torch compile"]["ms"] != by["torch compile"]["ms"]  # nan: no rounds
    assert by["andrea"]["rounds_ms"] == [10.0] and log[-2:] == ["close andrea", "release"]


def test_long_runs_merge_with_the_engine_beside_the_fastest_pytorch_mode():
    b = _bench()
    runs = [{"andrea": {"ms": 100.0}, "torch compile": {"ms": 130.0}},
            {"andrea": {"ms": 101.0}, "torch reduce-overhead": {"ms": 120.0}},
            {"andrea": {"ms": 99.0}, "torch eager": {"failed": "failed: RuntimeError: x"}}]
    got = b.merge_sustained(runs)
    assert got["andrea"] == {"ms": 101.0}
    assert set(got) == {"andrea", "torch compile", "torch reduce-overhead", "torch eager"}
    assert b.merge_sustained(runs[2:])["andrea"] == {"ms": 99.0}
    assert b.merge_sustained([]) == {}


# --- the profile's split ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>",
     "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1", "attention"),
    ("kernel_cutlass_kernel_cudnnflex_attentionkernelssm90bwdbackwardFlexAttentionBackwardSm90",
     "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>",
     "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("k_attn_fwd", "attention"),
    ("k_layernorm_bwd", "other"),
    ("k_adamw_step", "other"),
    ("k_fp8_cast_t64", "other"),
    ("triton_poi_fused__scaled_dot_product_flash_attention_transpose_0", "other"),
    ("triton_red_fused_native_layer_norm_1", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
])
def test_kernel_kinds(name, kind):
    assert _profile().kernel_kind(name) == kind


def test_the_split_sums_each_kind_and_rates_the_gemms():
    p = _profile()
    rows = [(6000.0, 10, "nvjet_tst_a"), (2000.0, 4, "sm90_xmma_gemm_b"),
            (1500.0, 2, "cudnn_generated_fort_native_sdpa_c"), (500.0, 30, "k_layernorm_fwd")]
    split = p.kernel_split(rows, 4e12)
    assert split["gemm_ms"] == 8.0 and split["attention_ms"] == 1.5 and split["other_ms"] == 0.5
    assert split["total_ms"] == 10.0 and split["gemm_share"] == pytest.approx(0.8)
    assert split["gemm_tflops"] == pytest.approx(500.0)  # 4 TFLOP in 8 ms
    assert p.kernel_split([], 1.0)["gemm_tflops"] == 0.0
    line = p.split_line(split)
    assert line.startswith("GEMMs 8.00 ms (80%, 500 TFLOP/s), attention 1.50 ms (15%)")


def test_the_profiles_run_the_paths_asked_and_outlive_pytorch_failing(monkeypatch, capsys):
    p, m = _profile(), _models()
    log: list[str] = []
    path = {id(m.CLASSIC): "classic", id(m.FUSED): "fused", id(m.FP8): "fp8"}
    rows = [(1000.0, 1.0, "nvjet_a")]
    prof = {"rows": rows, "total_us": 1000.0, "kernels": 1.0, "choices": {},
            "split": p.kernel_split(rows, 1e9)}

    def profile_andrea(s: Any, opts: dict[str, Any]) -> dict[str, Any]:
        log.append(path[id(opts)])
        return prof

    def profile_torch(s: Any, variant: str) -> dict[str, Any]:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(p, "profile_andrea", profile_andrea)
    monkeypatch.setattr(p, "profile_torch", profile_torch)
    monkeypatch.setattr(p, "release_torch", lambda reset_compiled=True: log.append("release"))
    out: dict[str, Any] = {}
    p.run_profiles(["12M"], ["fused", "fp8"], "reduce-overhead", out)
    assert log == ["fused", "fp8", "release"]
    assert set(out) == {"12M"} and set(out["12M"]) == {"fused", "fp8"}
    assert out["12M"]["fused"]["total_ms"] == 1.0
    assert "ANDREA-12M torch reduce-overhead: profile failed: RuntimeError: CUDA out of memory" \
        in capsys.readouterr().out
    p.print_split(out)
    assert "  ANDREA-12M fp8: 1.00 ms: GEMMs 1.00 ms (100%" in capsys.readouterr().out


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "says"), [
    (["--models", "120M,7B"], "--models: unknown '7B'; known: 120M, 12M, 312M, 1.2B"),
    (["--profile", "2B"], "--profile: unknown '2B'"),
    (["--paths", "classic"], "--paths: expected fused among them"),
    (["--paths", "fused,fp16"], "--paths: unknown 'fp16'; known: fused, classic, fp8"),
    (["--profile-torch", "eagre"], "--profile-torch: PyTorch variant 'eagre'"),
])
def test_refusals(args, says):
    b = _bench()
    a = b.parse_args(args)
    assert b.refusal(a, b.csv(a.torch), ()).startswith(says)


def test_fp8_is_an_alias_that_adds_the_path():
    b = _bench()
    assert b.engine_paths(b.parse_args([])) == ["fused", "classic"]
    assert b.engine_paths(b.parse_args(["--fp8"])) == ["fused", "classic", "fp8"]
    assert b.engine_paths(b.parse_args(["--fp8", "--paths", "fused,fp8"])) == ["fused", "fp8"]
    a = b.parse_args(["--models", "312M,1.2B", "--profile-torch"])
    assert b.refusal(a, b.csv(a.torch), ()) == "" and a.profile_torch == "reduce-overhead"


def test_long_runs_happen_once_a_model_in_the_first_group_that_can(fake_bench, monkeypatch):
    """--sustained in groups: the fused path's long run beside the first PyTorch mode that can
    (the fastest expected runs first), not again in each later group (minutes each at 1.2B);
    a model with no such group says the long runs were skipped."""
    b, _log = fake_bench
    m = _models()
    runs: list[list[str]] = []
    monkeypatch.setattr(b, "bench_sustained", lambda key, impls, *a: runs.append(list(impls))
                        or {n: {"ms": 1.0} for n in impls})
    monkeypatch.setattr(b.EnergyMeter, "open", staticmethod(lambda: None))
    monkeypatch.setattr(b, "engine_bytes", lambda s, opts, switched=None: {
        id(m.FUSED): 30 * GIB, id(m.CLASSIC): 60 * GIB}[id(opts)])
    monkeypatch.setattr(b, "torch_bytes", lambda s: 30 * GIB)
    notes: dict[str, Any] = {}
    b.bench_model("1.2B", ["eager", "compile", "reduce-overhead"], steps=2, rounds=1,
                  notes=notes, sustained=10)
    assert runs == [["andrea", "torch reduce-overhead"]]
    monkeypatch.setattr(b, "torch_bytes", lambda s: 60 * GIB)  # nothing beside the fused path
    runs.clear()
    b.bench_model("1.2B", ["eager"], steps=2, rounds=1, notes=notes, sustained=10)
    assert runs == [] and "no group held the fused path" in notes["1.2B"]["sustained_skipped"]


# --- the report -----------------------------------------------------------------------------------


def _row(key: str, impl: str, ms: float) -> dict[str, Any]:
    return {"model": f"ANDREA-{key}", "impl": impl, "ms": ms, "mfu": 0.5}


@pytest.mark.parametrize(("key", "goal", "fp8_goal"), [("12M", "1.25x", None),
                                                       ("120M", "1.25x", None),
                                                       ("312M", "1.15x", None),
                                                       ("1.2B", "1.15x", "1.20x")])
def test_the_report_holds_each_size_to_its_own_goal(key, goal, fp8_goal, capsys):
    """The ratio to the fastest PyTorch mode is held to its size's goal (lower where the GEMMs
    dominate); fp8's ratio to bf16 names a goal at 1.2B alone."""
    b = _bench()
    out = {"rows": [_row(key, "andrea", 100.0), _row(key, "andrea fp8", 80.0),
                    _row(key, "torch eager", 150.0), _row(key, "torch reduce-overhead", 120.0)],
           "notes": {}}
    b.print_model_lines(key, out, b.parse_args([]))
    lines = capsys.readouterr().out.splitlines()
    assert f"ANDREA-{key}: andrea 100.00 ms (MFU 50.0%) vs the fastest PyTorch (torch " \
           f"reduce-overhead) 120.00 ms (MFU 50.0%): 1.20x (goal {goal})" in lines
    fp8 = next(line for line in lines if "andrea fp8" in line)
    assert fp8.startswith(f"ANDREA-{key}: andrea fp8 80.00 ms vs the engine's bf16 100.00 ms: "
                          "1.25x")
    assert ("goal" in fp8) == (fp8_goal is not None)
    if fp8_goal:
        assert f"(goal {fp8_goal})" in fp8
    assert set(_models().SPEEDUP_GOAL) == set(_models().MODELS)
