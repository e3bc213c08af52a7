"""The CUDA backend's choices as configuration, on the CPU: the config's gpu section (its
defaults, what it refuses, how a run records it), the one translation of a checkpoint written
before the section existed (its state.json `cuda_settings`), and the data-parallel check that
every rank resolved the section alike. Runs on the GPU: tests/gpu/test_train_resume.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from engine.config import (
    STATE_CUDA_SETTINGS,
    ConfigError,
    GpuConfig,
    gpu_section_of_checkpoint,
    parse_config,
)
from engine.errors import UserError
from engine.run.ddp import check_same_collectives, collective_settings
from tests.conftest import ROOT, micro_config_dict

DEFAULTS = {"attention": "auto", "flex_backward": True, "qkv_rows": True,
            "logits_low_precision": True, "grads_low_precision": True, "attention_chunk": 256,
            "gemm_tune": True, "gemm_candidates": 8, "fusions": True, "gelu_in_gemm": True,
            "ddp_overlap": True}


def _parse(gpu: Any = None, **train: Any) -> Any:
    raw = micro_config_dict(**train)
    if gpu is not None:
        raw["gpu"] = gpu
    return parse_config(raw, "cfg.json", ROOT)


def test_the_section_s_defaults_are_what_ran_before_it_was_configurable() -> None:
    assert dataclasses.asdict(GpuConfig()) == DEFAULTS


def test_a_config_without_the_section_runs_the_defaults_and_records_them_whole() -> None:
    cfg = _parse()
    assert cfg.gpu == GpuConfig()
    assert cfg.to_json()["gpu"] == DEFAULTS  # what config.json and every checkpoint keep
    again = parse_config(cfg.to_json(), "config.json", ROOT)
    assert again == cfg
    some = _parse({"attention": "classic", "attention_chunk": 64, "fusions": False})
    assert some.gpu == GpuConfig(attention="classic", attention_chunk=64, fusions=False)
    assert parse_config(some.to_json(), "config.json", ROOT).gpu == some.gpu


@pytest.mark.parametrize(("gpu", "said"), [
    ({"attention": "fast"}, "gpu.attention: must be one of auto, cudnn, classic; got 'fast'"),
    ({"fusions": "yes"}, "gpu.fusions: must be true or false, got 'yes'"),
    ({"flex_backward": 1}, "gpu.flex_backward: must be true or false, got 1"),
    ({"attention_chunk": 0}, "gpu.attention_chunk: must be >= 1, got 0"),
    ({"gemm_candidates": 65}, "gpu.gemm_candidates: must be <= 64, got 65"),
    ({"fusion": True}, "gpu.fusion: unknown key (did you mean 'fusions'?)"),
    ([], "gpu: must be an object, got list"),
])
def test_a_bad_value_names_the_file_and_the_json_path(gpu: Any, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        _parse(gpu)
    assert str(e.value).startswith(f"cfg.json: {said}"), str(e.value)


def test_fp8_needs_the_fused_path() -> None:
    assert _parse({"fusions": True}, precision="fp8").gpu.fusions
    with pytest.raises(ConfigError, match=r"^cfg\.json: gpu\.fusions: must be true with "
                                          r"train\.precision fp8"):
        _parse({"fusions": False}, precision="fp8")


def test_the_command_line_s_attention_overrides_the_section() -> None:
    cfg = _parse({"attention": "cudnn", "qkv_rows": False})
    assert cfg.with_attention("classic").gpu == GpuConfig(attention="classic", qkv_rows=False)
    with pytest.raises(UserError, match="--attention: expected one of auto, cudnn, classic"):
        cfg.with_attention("flash")


# ---------------------------------------------------------------- checkpoints before the section


def _state(record: Any = None, backend: str = "cuda", precision: str = "bf16") -> dict:
    state: dict[str, Any] = {"backend": backend, "config": {"train": {"precision": precision}}}
    if record is not None:
        state[STATE_CUDA_SETTINGS] = record
    return state


def test_no_record_is_the_defaults_and_a_gpu_run_s_says_so() -> None:
    assert gpu_section_of_checkpoint(_state(backend="numpy")) == ({}, [])
    assert gpu_section_of_checkpoint("not a state") == ({}, [])
    gpu, notes = gpu_section_of_checkpoint(_state())
    # a GPU run from before the record, so from before the paths that came after it
    assert gpu == {"flex_backward": False, "grads_low_precision": False,
                   "logits_low_precision": False} and len(notes) == 1
    assert notes[0].startswith("the checkpoint records no CUDA settings (written before the "
                               "engine recorded them): gpu.flex_backward false")


def test_a_record_translates_switch_by_switch() -> None:
    record = {"attention": "cudnn", "ANDREA_FUSIONS": True, "ANDREA_GELU_FUSION": False,
              "ANDREA_QKV_ROWS": False, "ANDREA_LOGITS_LP": True, "ANDREA_GRADS_LP": True,
              "ANDREA_FLEX_BWD": True, "ANDREA_SIDE_STREAM": True, "ANDREA_DEFER_ADAMW": True}
    gpu, notes = gpu_section_of_checkpoint(_state(record))
    assert gpu == {"fusions": True, "gelu_in_gemm": False, "qkv_rows": False,
                   "logits_low_precision": True, "grads_low_precision": True,
                   "flex_backward": True}  # cudnn: auto takes cuDNN's where it runs
    assert notes == []


def test_switches_a_record_lacks_ran_as_they_did_before_they_existed() -> None:
    """The logits and the weight gradients in low precision and the flex backward came after
    the record did: a record without them ran without them; the older switches ran on."""
    gpu, _ = gpu_section_of_checkpoint(_state({"attention": "cudnn", "ANDREA_FUSIONS": True}))
    assert gpu == {"fusions": True, "gelu_in_gemm": True, "qkv_rows": True,
                   "logits_low_precision": False, "grads_low_precision": False,
                   "flex_backward": False}


@pytest.mark.parametrize(("attention", "precision", "expected"), [
    ("classic", "bf16", "classic"),  # chosen (or cuDNN missing) where cuDNN's could have run
    ("classic", "fp32", None),  # fp32's only path: auto, so another precision may pick afresh
    ("cudnn", "bf16", None),
])
def test_the_attention_path(attention: str, precision: str, expected: str | None) -> None:
    record = {"attention": attention, "ANDREA_ATTN_CHUNK": 64}
    gpu, _ = gpu_section_of_checkpoint(_state(record, precision=precision))
    assert gpu.get("attention") == expected and gpu["attention_chunk"] == 64


def test_a_path_the_engine_no_longer_has_is_said_where_its_bits_differed() -> None:
    record = {"attention": "cudnn", "ANDREA_RESID_GEMM": True, "ANDREA_WRITE_GRADS": False,
              "ANDREA_SIDE_STREAM": False, "ANDREA_FUSED_LN": True, "ANDREA_DWTE_PAD": False,
              "ANDREA_DEFER_ADAMW": False}
    _, notes = gpu_section_of_checkpoint(_state(record))
    # (the side stream and the deferred update computed the same bits either way: no note)
    assert notes == [f"the checkpoint's run had ANDREA_{k}, a path the engine no longer has: "
                     f"the bits may differ from an uninterrupted run"
                     for k in ("WRITE_GRADS=0", "RESID_GEMM=1", "FUSED_LN=1", "DWTE_PAD=0")]


def test_what_it_translates_is_checked_as_the_config_is() -> None:
    """A hostile record gives values the config refuses, naming the checkpoint's file."""
    gpu, _ = gpu_section_of_checkpoint(_state({"attention": "cudnn", "ANDREA_ATTN_CHUNK": -5,
                                               "ANDREA_QKV_ROWS": "yes", 7: True}))
    assert gpu["qkv_rows"] is True  # not a bool: as if not recorded
    raw = {**micro_config_dict(), "gpu": gpu}
    with pytest.raises(ConfigError, match=r"^x/state\.json: config: gpu\.attention_chunk: must "
                                          r"be >= 1, got -5"):
        parse_config(raw, "x/state.json: config", ROOT)
    del gpu["attention_chunk"]
    assert parse_config({**micro_config_dict(), "gpu": gpu}, "s", ROOT).gpu.qkv_rows


def test_the_loop_gives_an_old_checkpoint_s_config_its_run_s_section() -> None:
    """TrainingRun._checkpoint_config on the CPU: the section added and said in the log; a
    config with the section, or none that is an object, left as it is."""
    from engine.run.loop import TrainingRun

    logged: list[str] = []
    run = object.__new__(TrainingRun)
    run.out = SimpleNamespace(log=logged.append)
    config = micro_config_dict(precision="bf16")
    state = {**_state({"attention": "classic", "ANDREA_RESID_GEMM": True}), "config": config}
    got = run._checkpoint_config(state)
    assert got["gpu"]["attention"] == "classic" and "gpu" not in config
    assert logged[0].startswith("resume: the checkpoint's config has no gpu section (written "
                                "before it existed): its run's settings go on as gpu: fusions "
                                "true, ")
    assert logged[1].startswith("resume: the checkpoint's run had ANDREA_RESID_GEMM=1")
    logged.clear()
    assert run._checkpoint_config({"config": got}) is got and logged == []
    assert run._checkpoint_config({"config": [1]}) == [1]


# ---------------------------------------------------------------- data parallel


def test_data_parallel_ranks_that_resolve_the_section_otherwise_are_refused() -> None:
    backend = SimpleNamespace(resolved={"attention": "cudnn", "qkv_rows": True, "fusions": True},
                              use_graphs=True)
    mine = collective_settings(SimpleNamespace(in_step=True), backend)  # type: ignore[arg-type]
    assert mine == {"gpu.attention": "cudnn", "gpu.qkv_rows": True, "gpu.fusions": True,
                    "gpu.ddp_overlap": True, "ANDREA_CUDA_GRAPHS": True}
    check_same_collectives([mine, dict(mine)])
    for other, said in (({**mine, "gpu.attention": "classic"},
                         "gpu.attention on rank 0 cudnn, on rank 1 classic"),
                        ({**mine, "gpu.qkv_rows": False},
                         "gpu.qkv_rows on rank 0 on, on rank 1 off"),
                        ({**mine, "gpu.attention_chunk": 64},
                         "gpu.attention_chunk on rank 0 unset, on rank 1 64")):
        with pytest.raises(UserError) as e:
            check_same_collectives([mine, other])
        assert said in str(e.value) and "ANDREA_FLEX_LIB" in str(e.value)
