"""The CUDA backend's recorded settings (state.json `cuda_settings`), on the CPU: how a switch is
resolved (the environment, else the resumed run's record, else the default) and what a
checkpoint's record may hold. The resume itself runs on the GPU (tests/gpu/test_train_resume.py)."""

from __future__ import annotations

import pytest

from engine.backends.cuda.backend import CudaBackend
from engine.backends.cuda.runtime import Gpu
from engine.backends.cuda.settings import CudaSettings, count_value, switch_value
from engine.errors import UserError
from engine.model.layout import ModelShapes
from engine.records import STATE_CUDA_SETTINGS, cuda_settings_of


@pytest.mark.parametrize(("raw", "recorded", "default", "want"), [
    (None, None, True, True),  # nothing said: the default
    (None, None, False, False),
    (None, True, False, True),  # the run's record over the default
    (None, False, True, False),
    ("0", True, True, False),  # the environment over the record
    ("1", False, False, True),
    ("yes", False, False, True),  # anything but "0" is on, as for every ANDREA_* switch
    (None, "1", False, False),  # a record that is not a bool is not one
    (None, 1, True, True),
])
def test_a_switch_is_the_environment_then_the_record_then_the_default(raw, recorded, default,
                                                                       want) -> None:
    assert switch_value(raw, recorded, default) is want


def test_the_record_keeps_switches_counts_and_the_attention_path() -> None:
    state = {STATE_CUDA_SETTINGS: {"ANDREA_QKV_ROWS": True, "ANDREA_RESID_GEMM": False,
                                   "ANDREA_ATTN_CHUNK": 128, "attention": "classic"}}
    assert cuda_settings_of(state) == {"ANDREA_QKV_ROWS": True, "ANDREA_RESID_GEMM": False,
                                       "ANDREA_ATTN_CHUNK": 128, "attention": "classic"}


@pytest.mark.parametrize(("raw", "recorded", "want"), [
    (None, None, 256),  # nothing said: the default
    (None, 128, 128),  # the run's record over the default
    ("64", 128, 64),  # the environment over the record
    (" 512 ", None, 512),
    ("00000000064", None, 64),  # leading zeros are no digits too many
    ("0" * 4999 + "7", None, 7),
    (None, True, 256),  # a bool is no count, nor a string, nor zero
    (None, "64", 256),
    (None, 0, 256),
])
def test_a_count_is_the_environment_then_the_record_then_the_default(raw, recorded,
                                                                     want) -> None:
    assert count_value("ANDREA_ATTN_CHUNK", raw, recorded, 256) == want


@pytest.mark.parametrize("raw", ["", "abc", "0", "-4", "1.5", "1e3", str(2**31), "٣",
                                 "1" * 5000, "0" * 20, "0" * 5000])
def test_a_bad_count_in_the_environment_is_a_user_error(raw) -> None:
    with pytest.raises(UserError, match=r"ANDREA_ATTN_CHUNK: expected an integer from 1 to "):
        count_value("ANDREA_ATTN_CHUNK", raw, None, 256)


@pytest.mark.parametrize("state", [
    None, [], {}, {"step": 3}, {STATE_CUDA_SETTINGS: None}, {STATE_CUDA_SETTINGS: []},
    {STATE_CUDA_SETTINGS: "ANDREA_QKV_ROWS"},
])
def test_no_record_is_no_settings(state) -> None:
    assert cuda_settings_of(state) == {}


def test_a_hostile_record_leaves_only_what_it_may_hold() -> None:
    """A hand-edited or corrupt state.json: switches that are not booleans, counts that are not
    whole numbers from 1 (a bool is none), names that are not ANDREA_* settings, an attention
    path that does not exist, and a flood of keys."""
    junk = {"ANDREA_QKV_ROWS": "1", "ANDREA_FUSIONS": 0, "PATH": True, "attention": "flash",
            "ANDREA_" + "X" * 100: True, 7: True, "ANDREA_RESID_GEMM": True,
            "ANDREA_ATTN_CHUNK": -5, "ANDREA_SIDE_STREAM": 2**40, "ANDREA_DWTE_PAD": 1.0,
            "CHUNK": 8, "ANDREA_WRITE_GRADS": 1}
    assert cuda_settings_of({STATE_CUDA_SETTINGS: junk}) == {"ANDREA_RESID_GEMM": True}
    assert cuda_settings_of({STATE_CUDA_SETTINGS: {"ANDREA_ATTN_CHUNK": True}}) == {}
    flood = {f"ANDREA_S{i}": True for i in range(1000)}
    assert len(cuda_settings_of({STATE_CUDA_SETTINGS: flood})) == 64


def _settings(recorded: dict) -> CudaSettings:
    return CudaSettings(recorded, [])


def test_flag_takes_up_the_record_and_notes_an_environment_against_it(monkeypatch) -> None:
    for name in ("ANDREA_RESID_GEMM", "ANDREA_QKV_ROWS", "ANDREA_SIDE_STREAM"):
        monkeypatch.delenv(name, raising=False)
    st = _settings({"ANDREA_RESID_GEMM": True, "ANDREA_QKV_ROWS": True, "attention": "cudnn"})
    assert st.flag("ANDREA_RESID_GEMM", default=False) is True  # the record over the default
    assert st.notes == []
    monkeypatch.setenv("ANDREA_QKV_ROWS", "0")
    assert st.flag("ANDREA_QKV_ROWS") is False  # the environment over the record, said
    assert st.notes == ["ANDREA_QKV_ROWS=0 from the environment, where the run recorded 1: the "
                        "bits may differ from an uninterrupted run"]
    monkeypatch.setenv("ANDREA_SIDE_STREAM", "0")
    assert st.flag("ANDREA_SIDE_STREAM") is False  # nothing recorded: nothing to note
    assert len(st.notes) == 1
    # what the next checkpoint records: every switch as resolved
    assert st.values == {"ANDREA_RESID_GEMM": True, "ANDREA_QKV_ROWS": False,
                           "ANDREA_SIDE_STREAM": False}


def test_count_takes_up_the_record_and_records_only_where_it_decides(monkeypatch) -> None:
    monkeypatch.delenv("ANDREA_ATTN_CHUNK", raising=False)
    st = _settings({"ANDREA_ATTN_CHUNK": 128})
    assert st.count("ANDREA_ATTN_CHUNK", 256) == 128 and st.notes == []
    assert st.values == {"ANDREA_ATTN_CHUNK": 128}
    monkeypatch.setenv("ANDREA_ATTN_CHUNK", "128")  # the same as recorded: nothing to say
    assert st.count("ANDREA_ATTN_CHUNK", 256) == 128 and st.notes == []
    monkeypatch.setenv("ANDREA_ATTN_CHUNK", "64")
    assert st.count("ANDREA_ATTN_CHUNK", 256) == 64
    assert st.notes == ["ANDREA_ATTN_CHUNK=64 from the environment, where the run recorded 128: "
                        "the bits may differ from an uninterrupted run"]
    # cuDNN's attention has no chunks: checked, not recorded, nothing noted
    st = _settings({"ANDREA_ATTN_CHUNK": 128})
    assert st.count("ANDREA_ATTN_CHUNK", 256, record=False) == 64
    assert st.values == {} and st.notes == []
    monkeypatch.setenv("ANDREA_ATTN_CHUNK", "many")
    with pytest.raises(UserError, match="ANDREA_ATTN_CHUNK"):
        st.count("ANDREA_ATTN_CHUNK", 256, record=False)


def test_a_record_without_the_count_says_the_default_runs(monkeypatch) -> None:
    """A checkpoint recorded before the chunk was (when the README said to keep it by hand):
    the default runs and the log says so; a start with no record at all says nothing."""
    monkeypatch.delenv("ANDREA_ATTN_CHUNK", raising=False)
    st = _settings({"attention": "classic", "ANDREA_FUSIONS": True})
    assert st.count("ANDREA_ATTN_CHUNK", 256, expected=True) == 256
    assert st.notes == ["ANDREA_ATTN_CHUNK: the run's record has none (written before it was "
                        "recorded): 256 runs; if the run ran with another, set ANDREA_ATTN_CHUNK "
                        "to it"]
    fresh = _settings({})
    assert fresh.count("ANDREA_ATTN_CHUNK", 256) == 256 and fresh.notes == []
    # a cuDNN run's record has no chunk to hold (the classic attention runs now: nothing to say
    # of the chunk; the attention path's own note says the bits differ)
    cudnn = _settings({"attention": "cudnn", "ANDREA_FUSIONS": True})
    assert cudnn.count("ANDREA_ATTN_CHUNK", 256, expected=False) == 256 and cudnn.notes == []


class _NoGpu(Exception):
    """Raised where CudaBackend.__init__ first asks for the GPU: what it decided before is
    checked on the CPU."""


SHAPES = ModelShapes(n_layer=1, d_model=64, n_head=2, d_ff=128, vocab_size=64, seq_len=16)


def _start_until_the_gpu(monkeypatch, **kw) -> CudaBackend:
    def no_gpu() -> None:
        raise _NoGpu

    monkeypatch.setattr(Gpu, "get", staticmethod(no_gpu))
    bk = object.__new__(CudaBackend)
    with pytest.raises(_NoGpu):
        bk.__init__(SHAPES, 2, **kw)
    # what the run records and logs is the settings object's own (filled in place)
    assert bk.settings is bk._cuda.values and bk._cuda.notes is bk.notes
    return bk


def test_fp8_over_a_recorded_fusions_off_turns_them_on_and_says_so(monkeypatch) -> None:
    monkeypatch.delenv("ANDREA_FUSIONS", raising=False)
    bk = _start_until_the_gpu(monkeypatch, precision="fp8",
                              settings={"ANDREA_FUSIONS": False})
    assert bk.fusions is True and bk.settings["ANDREA_FUSIONS"] is True
    assert any("the run recorded 0, and fp8 runs on the fused path" in n for n in bk.notes)
    # the record alone: bf16 keeps it
    bk = _start_until_the_gpu(monkeypatch, precision="bf16", settings={"ANDREA_FUSIONS": False})
    assert bk.fusions is False and bk.notes == []
    # the environment against the record: it wins, and the backend's notes say so
    monkeypatch.setenv("ANDREA_FUSIONS", "1")
    bk = _start_until_the_gpu(monkeypatch, precision="bf16", settings={"ANDREA_FUSIONS": False})
    assert bk.fusions is True and bk.settings["ANDREA_FUSIONS"] is True
    assert bk.notes == ["ANDREA_FUSIONS=1 from the environment, where the run recorded 0: the "
                        "bits may differ from an uninterrupted run"]


def test_fp8_with_fusions_off_in_the_environment_is_refused(monkeypatch) -> None:
    """The environment's word over the record: fp8 without the fused path is a user error."""
    monkeypatch.setenv("ANDREA_FUSIONS", "0")
    with pytest.raises(UserError, match="ANDREA_FUSIONS=0 turns it off"):
        object.__new__(CudaBackend).__init__(SHAPES, 2, precision="fp8",
                                             settings={"ANDREA_FUSIONS": True})


def test_data_parallel_ranks_that_compute_otherwise_are_refused() -> None:
    """Only rank 0 writes a log, so a rank whose attention path or switch resolved otherwise
    (its own environment, a cuDNN that does not start there) is refused, naming both values."""
    from engine.run.ddp import check_same_collectives, collective_settings

    class Reducer:
        in_step = True

    class Backend:
        fused_step = use_graphs = True

        def __init__(self) -> None:
            self.settings = {"attention": "cudnn", "ANDREA_QKV_ROWS": True}

    mine = collective_settings(Reducer(), Backend())
    assert mine["attention"] == "cudnn" and mine["ANDREA_QKV_ROWS"] is True
    check_same_collectives([mine, dict(mine)])
    for other, said in (({**mine, "attention": "classic"}, "attention on rank 0 cudnn, on rank 1 "
                         "classic"),
                        ({**mine, "ANDREA_QKV_ROWS": False}, "ANDREA_QKV_ROWS on rank 0 on, on "
                         "rank 1 off"),
                        ({**mine, "ANDREA_ATTN_CHUNK": 64}, "ANDREA_ATTN_CHUNK on rank 0 unset, "
                         "on rank 1 64")):
        with pytest.raises(UserError) as e:
            check_same_collectives([mine, other])
        assert said in str(e.value)


def _options_of(state: dict, tmp_path) -> tuple[dict, list[str]]:
    """TrainingRun._backend_options for a CUDA resume from a checkpoint with this state.json,
    on the CPU (nothing it reads needs a GPU): (the backend's options, what it logged)."""
    from types import SimpleNamespace

    from engine.run.loop import RunOptions, TrainingRun

    logged: list[str] = []
    run = object.__new__(TrainingRun)
    run.args = RunOptions(resume=True)
    run.out = SimpleNamespace(paths=SimpleNamespace(gemm_plan=tmp_path / "gemm_plan.json"),
                              log=logged.append)
    run.cfg = SimpleNamespace(train=SimpleNamespace(precision="bf16"))
    run._saved_precision = "bf16"
    return run._backend_options("cuda", SimpleNamespace(state=state)), logged


def test_a_resume_takes_up_the_record_and_says_so(tmp_path) -> None:
    opts, logged = _options_of({"backend": "cuda", STATE_CUDA_SETTINGS: {
        "attention": "classic", "ANDREA_ATTN_CHUNK": 64, "ANDREA_QKV_ROWS": True}}, tmp_path)
    assert opts["settings"] == {"attention": "classic", "ANDREA_ATTN_CHUNK": 64,
                                "ANDREA_QKV_ROWS": True}
    assert ("resume: the run's CUDA settings from the checkpoint: attention=classic, "
            "ANDREA_ATTN_CHUNK=64, ANDREA_QKV_ROWS=1") in logged


def test_a_checkpoint_from_before_the_record_is_said(tmp_path) -> None:
    """A CUDA checkpoint written before runs recorded their settings: today's defaults run,
    and the log says that the bits may then differ; a CPU checkpoint has nothing to record."""
    opts, logged = _options_of({"backend": "cuda", "step": 40}, tmp_path)
    assert opts["settings"] == {}
    assert any("the checkpoint records no CUDA settings" in line for line in logged), logged
    _, logged = _options_of({"backend": "numpy", "step": 40}, tmp_path)
    assert not any("records no CUDA settings" in line for line in logged), logged
