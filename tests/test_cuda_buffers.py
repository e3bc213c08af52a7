"""The CUDA buffer table (engine/backends/cuda/buffers.py), checked on the CPU: no GPU, no pycuda.

The plan totals are the bytes the backend planned before the table existed, and every device
address the forward, backward and sampling paths compute is compared, on a fake allocation, with
the formulas the backend used then (kept below as the reference, `_OldBatch` and `_old_*`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.backends.activations import LAYER, SAVED, SCRATCH, Dims, saved
from engine.backends.cuda.buffers import HP_FIELDS, io_fields, logits_ld, plan_memory
from engine.backends.cuda.cublas import WORKSPACE_BYTES
from engine.backends.cuda.memory import Plan
from engine.backends.cuda.ops import LN_ROWS_PER_CHUNK, LOSS_ROW_MAX
from engine.backends.cuda.optim_ops import NORM_BLOCKS, NORM_RANGE_BLOCKS
from engine.backends.cuda.runtime import ACT_BYTES
from engine.model.layout import ModelShapes, n_params, tensor_table

TINY = ModelShapes(n_layer=4, d_model=128, n_head=4, d_ff=512, vocab_size=8449, seq_len=128)
M12 = ModelShapes(n_layer=6, d_model=384, n_head=6, d_ff=1536, vocab_size=8449, seq_len=1024)
M120 = ModelShapes(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=8449, seq_len=1024)
ODD = ModelShapes(n_layer=3, d_model=24, n_head=3, d_ff=40, vocab_size=97, seq_len=7)

# Bytes per group at micro-batch 8, as planned before the table (120M bf16: weights 527.8 MiB,
# grads, m, v 351.9 MiB each, activations 5.4 GiB, scratch 515.4 MiB).
TOTALS = {
    ("tiny", "bf16"): dict(weights=11319552, grads=7546368, adam_m=7546368, adam_v=7546368,
                           activations=63498240, scratch=55128064, total=152584960),
    ("12M", "bf16"): dict(weights=85586688, grads=57057792, adam_m=57057792, adam_v=57057792,
                          activations=1687928832, scratch=356837120, total=2301526016),
    ("120M", "bf16"): dict(weights=553489920, grads=368993280, adam_m=368993280,
                           adam_v=368993280, activations=5779832832, scratch=540469504,
                           total=7980772096),
    ("120M", "fp32"): dict(weights=368993280, grads=368993280, adam_m=368993280,
                           adam_v=368993280, activations=11243962368, scratch=1046407424,
                           total=13766342912),
}
SHAPES = {"tiny": TINY, "12M": M12, "120M": M120, "odd": ODD}


@pytest.mark.parametrize("key", sorted(TOTALS), ids="-".join)
def test_plan_totals_are_unchanged(key):
    plan, _, _ = plan_memory(SHAPES[key[0]], 8, key[1])
    assert plan.totals() == TOTALS[key]


# --- the reference: the backend's formulas before the table ----------------------------------


class _OldBatch:
    def __init__(self, prefix, B, s, es, ldv, training):
        self.p, self.B, self.training = prefix, B, training
        L, d, F, S, H = s.n_layer, s.d_model, s.d_ff, s.seq_len, s.n_head
        R = self.R = B * S
        self.sizes = {
            "x": (L + 1) * R * d * es, "ln1": L * R * d * es, "ln1_stats": L * 2 * R * 4,
            "qkv": L * 3 * R * d * es, "probs": L * B * H * S * S * es, "att": L * R * d * es,
            "xmid": L * R * d * es, "ln2": L * R * d * es, "ln2_stats": L * 2 * R * 4,
            "pre": L * R * F * es, "act": L * R * F * es, "lnf": R * d * es,
            "lnf_stats": 2 * R * 4, "logits": R * ldv * 4, "lse": R * 4, "losses": R * 4,
        }
        self.scratch = {"scores": B * H * S * S * es, "tmp": R * d * es,
                        "io": (2 * R + 1 + R + (R + 1) + R + 1) * 4}
        if training:
            self.scratch.update({
                "dres": R * d * es, "dln": R * d * es, "datt": R * d * es,
                "dqkv": 3 * R * d * es, "dpre": R * F * es, "dlogits": R * ldv * es,
                "ln_partial": -(-R // LN_ROWS_PER_CHUNK) * 2 * d * 4})

    def plan(self, plan):
        for name, nbytes in self.sizes.items():
            plan.add("activations", self.p + name, nbytes)
        for name, nbytes in self.scratch.items():
            plan.add("scratch", self.p + name, nbytes)


def _old_plan(s, B, precision):
    n, es, ldv = n_params(s), ACT_BYTES[precision], -(-s.vocab_size // 64) * 64
    plan = Plan()
    plan.add("weights", "params", n * 4)
    if precision != "fp32":
        plan.add("weights", "params_lp", n * es)
    plan.add("grads", "grads", n * 4)
    plan.add("adam_m", "m", n * 4)
    plan.add("adam_v", "v", n * 4)
    train = _OldBatch("t.", B, s, es, ldv, training=True)
    sample = _OldBatch("s.", 1, s, es, ldv, training=False)
    train.plan(plan)
    sample.plan(plan)
    nseg = len(tensor_table(s))
    for name, nbytes in (("cublas_ws", WORKSPACE_BYTES), ("norm_partials", NORM_BLOCKS * 4),
                         ("norm", 4), ("seg_start", (nseg + 1) * 8), ("seg_decay", nseg * 4)):
        plan.add("scratch", name, nbytes)
    return plan, train, sample


def _old_layer_act(P, s, es, b, name, l):
    Rm = b.R
    d, F = s.d_model, s.d_ff
    per = {"x": Rm * d * es, "ln1": Rm * d * es, "ln1_stats": 2 * Rm * 4,
           "qkv": 3 * Rm * d * es, "att": Rm * d * es,
           "probs": b.B * s.n_head * s.seq_len**2 * es, "xmid": Rm * d * es,
           "ln2": Rm * d * es, "ln2_stats": 2 * Rm * 4, "pre": Rm * F * es,
           "act": Rm * F * es}[name]
    return P[b.p + name] + l * per


def _old_io(P, b):
    base, R = P[b.p + "io"], b.R
    return {"tokens": base, "targets": base + R * 4, "n_unique": base + 2 * R * 4,
            "bucket_tok": base + (2 * R + 1) * 4, "bucket_start": base + (3 * R + 1) * 4,
            "rows": base + (4 * R + 2) * 4, "scale": base + (5 * R + 2) * 4}


def _old_stage(h, b, inputs, targets, loss_scale):
    B, T = inputs.shape
    R, Rm = B * T, b.R
    h[:R] = inputs.reshape(-1)
    if targets is not None:
        h[Rm : Rm + R] = targets.reshape(-1)
    tok_tm = inputs.T.reshape(-1)
    order = np.argsort(tok_tm, kind="stable")
    sorted_tok = tok_tm[order]
    starts = np.flatnonzero(np.r_[True, sorted_tok[1:] != sorted_tok[:-1]])
    nu = starts.size
    h[2 * Rm] = nu
    h[2 * Rm + 1 : 2 * Rm + 1 + nu] = sorted_tok[starts]
    h[3 * Rm + 1 : 3 * Rm + 1 + nu] = starts
    h[3 * Rm + 1 + nu] = R
    h[4 * Rm + 2 : 4 * Rm + 2 + R] = order
    h[5 * Rm + 2 :].view(np.float32)[0] = loss_scale / R
    return T


class _FakeDrv:
    """mem_alloc hands out far-apart fake base addresses, one per group, in call order."""

    class Mem(int):
        def free(self):
            pass

    def __init__(self):
        self.next = 0x7F00_0000_0000

    def mem_alloc(self, nbytes):
        mem = self.Mem(self.next)
        self.next += (nbytes // 2**30 + 2) * 2**30
        return mem


# --- the table against the reference ---------------------------------------------------------

CASES = [(k, p, B) for k in ("tiny", "120M", "odd") for p in ("fp32", "bf16") for B in (1, 3, 8)]


@pytest.mark.parametrize("key, precision, B", CASES)
def test_every_address_is_the_old_one(key, precision, B):
    s = SHAPES[key]
    es = ACT_BYTES[precision]
    new, train, sample = plan_memory(s, B, precision)
    old, old_train, old_sample = _old_plan(s, B, precision)
    new.allocate(_FakeDrv())
    old.allocate(_FakeDrv())
    assert new.totals() == old.totals()
    # every plan entry (the CUDA scratch "tmp" is now the shared name "proj")
    for b in (old_train, old_sample):
        for name in (*b.sizes, *b.scratch):
            assert new[b.p + ("proj" if name == "tmp" else name)] == old[b.p + name], name
    for name in ("params", "grads", "m", "v", "cublas_ws", "norm_partials", "norm",
                 "seg_start", "seg_decay") + (("params_lp",) if precision != "fp32" else ()):
        assert new[name] == old[name], name
    # every per-layer address the forward and backward compute, and the io fields
    for b, ob in ((train, old_train), (sample, old_sample)):
        assert b.R == ob.R and b.B == ob.B
        for l in range(s.n_layer + 1):
            assert b.at("x", l) == _old_layer_act(old, s, es, ob, "x", l)
        for l in range(s.n_layer):
            got = b.layer(l)
            assert set(got) == {a.name for a in saved("cuda", LAYER)}
            for name, addr in got.items():
                assert addr == _old_layer_act(old, s, es, ob, name, l), (name, l)
        for name in ("lnf", "lnf_stats", "logits", "lse", "losses", "scores", "proj", "io"):
            assert b.at(name) == old[ob.p + ("tmp" if name == "proj" else name)], name
        assert b.io() == _old_io(old, ob)
        assert b.io_words * 4 == ob.scratch["io"]


@pytest.mark.parametrize("key, B", [("tiny", 8), ("odd", 3), ("odd", 1)])
def test_staging_writes_the_old_io_block(key, B):
    s = SHAPES[key]
    _, train, sample = plan_memory(s, B, "bf16")
    _, old_train, old_sample = _old_plan(s, B, "bf16")
    rng = np.random.default_rng(5)
    for b, ob in ((train, old_train), (sample, old_sample)):
        for T in sorted({1, 2, s.seq_len // 2, s.seq_len}):
            x = rng.integers(0, 6, size=(b.B, T)).astype(np.int32)  # repeated ids: buckets
            y = rng.integers(0, s.vocab_size, size=(b.B, T)).astype(np.int32)
            y = y if b.training else None
            got = np.full(b.io_words, -7, np.int32)
            want = np.full(ob.scratch["io"] // 4, -7, np.int32)
            assert b.stage(got, x, y, 3.0) == _old_stage(want, ob, x, y, 3.0) == T
            assert np.array_equal(got, want)


def test_slots_are_bounded():
    plan, train, _ = plan_memory(ODD, 2, "bf16")
    plan.allocate(_FakeDrv())
    train.at("x", ODD.n_layer)  # the stream has one slot more than there are layers
    with pytest.raises(IndexError):
        train.at("ln1", ODD.n_layer)
    with pytest.raises(IndexError):
        train.at("lnf", 1)


def test_io_fields_cover_the_block():
    f = io_fields(10)
    assert list(f) == ["tokens", "targets", "n_unique", "bucket_tok", "bucket_start", "rows",
                       "scale", "end"]
    assert f["end"] == 5 * 10 + 3 and logits_ld(8449) == 8512 and logits_ld(64) == 64


def test_one_vocabulary():
    """The CUDA slabs and the numpy arena regions carry the names of engine/backends/activations.py
    and hold the elements the table says per slot (fp32: 4 bytes each on the GPU)."""
    from engine.backends.numpy.model import NumpyBackend

    s, B = ODD, 3
    _, train, _ = plan_memory(s, B, "fp32")
    be = NumpyBackend(s, B)
    dims = Dims(B=B, T=s.seq_len, d=s.d_model, F=s.d_ff, H=s.n_head, V=s.vocab_size)
    cuda_dims = dataclasses.replace(dims, V=logits_ld(s.vocab_size))
    slabs = {n: sl for n, sl in train.slabs.items() if sl.group == "activations"}
    assert list(slabs) == [a.name for a in saved("cuda")]
    regions = {}
    for key, (_, size) in be._acts.offsets.items():
        regions.setdefault(key.split(".")[0], []).append(size)
    assert set(regions) == {a.name for a in saved("numpy")} | {"proj"}
    for a in SAVED:
        if a.kept_by("cuda"):
            assert slabs[a.name].slots == a.slots(s.n_layer), a.name
            assert slabs[a.name].slot_bytes == 4 * a.elems(cuda_dims), a.name
        if a.kept_by("numpy"):
            assert regions[a.name] == [a.elems(dims)] * a.slots(s.n_layer), a.name
    for a in SCRATCH:
        assert train.slabs[a.name].slot_bytes == 4 * a.elems(dims), a.name
        arena = be._acts if a.name == "proj" else be._scratch
        assert arena.offsets[a.name][1] == a.elems(dims), a.name


# --- the cuDNN attention and the fused step ---------------------------------------------------


@pytest.mark.parametrize("key", ["12M", "120M", "odd"])
def test_cudnn_plan_drops_the_probabilities(key):
    """cuDNN's attention keeps no [B,H,T,T] buffers (probs per layer, the scores scratch, for
    training and sampling) but its row statistics and its workspace: the plan shrinks by the
    difference (120M at B=8, bf16, with a 201 MiB workspace: 2.54 GiB)."""
    s, B, ws = SHAPES[key], 8, 201 << 20
    classic, ct, cs = plan_memory(s, B, "bf16")
    cudnn, nt, ns = plan_memory(s, B, "bf16", "cudnn", cudnn_workspace=ws)
    cudnn.allocate(_FakeDrv())
    for b in (nt, ns):
        assert {"probs", "scores"}.isdisjoint(b.slabs)
        assert b.slabs["attn_stats"].slot_bytes == 4 * b.B * s.n_head * s.seq_len
        assert set(b.layer(0)) == {a.name for a in saved("cuda", LAYER, "cudnn")}
        assert "probs" not in b.layer(0) and "attn_stats" in b.layer(0)
    L, H, S = s.n_layer, s.n_head, s.seq_len

    def gone(b):  # the probabilities and scores, less the statistics (each rounded up to 256)
        up = lambda n: -(-n // 256) * 256  # noqa: E731
        return (up(L * b.B * H * S * S * 2) + up(b.B * H * S * S * 2)
                - up(L * b.B * H * S * 4))

    assert classic.totals()["total"] - cudnn.totals()["total"] == \
        gone(ct) + gone(cs) - -(-ws // 256) * 256
    if key == "120M":
        assert classic.totals()["total"] - cudnn.totals()["total"] > 2.5 * 2**30


def test_fused_plan_adds_the_second_copies_and_the_step_block():
    s = SHAPES["120M"]
    plan, train, sample = plan_memory(s, 8, "bf16", "cudnn", fused=True, cudnn_workspace=1)
    for name in ("dres2", "dpre2", "dqkv2"):
        assert train.slabs[name].nbytes == train.slabs[name[:-1]].nbytes
        assert name not in sample.slabs
    assert "hp" in train.io_fields and "hp" not in sample.io_fields
    plan.allocate(_FakeDrv())
    for name in ("cudnn_ws", "cublas_ws2", "norm_cuts", "clip", "skipped"):
        assert plan[name]
    # the norm's partials hold k_grad_norm_ranges' for the embeddings and every layer (norm
    # follows them in the plan), norm_cuts their L + 2 bounds (clip follows it)
    assert plan["norm"] - plan["norm_partials"] >= NORM_RANGE_BLOCKS * (s.n_layer + 1) * 4
    assert plan["clip"] - plan["norm_cuts"] >= (s.n_layer + 2) * 8
    h = np.zeros(train.io_words, np.int32)
    x = np.arange(8 * 16, dtype=np.int32).reshape(8, 16) % 7
    train.stage(h, x, x, 2.0)
    hp = dict(zip(HP_FIELDS, [1e-3, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05, 0.5, 1.0, 0.09, 0.04, 1.0],
                  strict=True))
    train.stage_hp(h, hp)
    at = train.io_fields["hp"]
    assert np.array_equal(h[at:at + len(HP_FIELDS)].view(np.float32),
                          np.array(list(hp.values()), np.float32))
    assert h[train.io_fields["scale"]:].view(np.float32)[0] == np.float32(2.0 / x.size)
    assert train.qkv_slab() == train.R * s.d_model


@pytest.mark.parametrize("vocab, shared", [(8449, True), (40_000, False)])
def test_logits_in_the_compute_precision_halve_their_slab_and_hold_dlogits(vocab, shared):
    """logits_lp: the training logits in bf16 (half the float32 slab), dlogits written over them
    where a row fits the loss kernel's registers (ops.LOSS_ROW_MAX), else a slab of their own;
    the sampling buffer's logits (logits_last) stay float32; fp32 runs ignore it."""
    s = dataclasses.replace(SHAPES["120M"], vocab_size=vocab)
    ldv = logits_ld(vocab)
    kw = {"attention": "cudnn", "fused": True, "cudnn_workspace": 1}
    plan32, train32, _ = plan_memory(s, 8, "bf16", **kw)
    plan, train, sample = plan_memory(s, 8, "bf16", logits_lp=True, **kw)
    R = train.R
    assert train32.slabs["logits"].nbytes == R * ldv * 4
    assert train.slabs["logits"].nbytes == R * ldv * 2
    assert sample.slabs["logits"].nbytes == sample.R * ldv * 4 and not sample.logits_lp
    assert ("dlogits" not in train.slabs) == shared == (ldv <= LOSS_ROW_MAX)
    saved_bytes = R * ldv * 2 + (R * ldv * 2 if shared else 0)
    assert plan32.totals()["total"] - plan.totals()["total"] == saved_bytes
    plan.allocate(_FakeDrv())
    assert (train.at("dlogits") == train.at("logits")) == shared
    _, train_fp32, _ = plan_memory(s, 8, "fp32", logits_lp=True, **kw)
    assert not train_fp32.logits_lp and "dlogits" in train_fp32.slabs
    with pytest.raises(ValueError, match="fused"):
        plan_memory(s, 8, "bf16", "cudnn", fused=False, logits_lp=True)


@pytest.mark.parametrize("qkv", [True, False])
def test_the_fp8_plan_names_its_buffers_in_a_group_of_its_own(qkv: bool):
    """train/precision fp8 (fp8.plan_fp8): per layer the FP8 weight copies (as stored and
    transposed: W1, W2, W_O, and W_QKV where the QKV map runs in FP8, Q, K, V in rows) and the
    transposed copies of the maps' inputs (made in the forward for the backward), one set of
    the other activation and gradient copies, the amax words and inverse scales, the delayed
    tensors' amax history and its next slot; the "fp8" group shows in the plan's totals only
    when it has buffers."""
    from engine.backends.cuda.fp8 import SCALE_STRIDE, TENSORS, plan_fp8
    from engine.model.fp8 import DELAYED, HISTORY

    s = SHAPES["120M"]
    plan, train, _ = plan_memory(s, 8, "bf16", "cudnn", fused=True, cudnn_workspace=1)
    assert "fp8" not in plan.totals()
    plan_fp8(plan, s.n_layer, s.d_model, s.d_ff, train.R, qkv=qkv)
    d, F, L, R = s.d_model, s.d_ff, s.n_layer, train.R
    weights = 2 * (2 * d * F + d * d + (3 * d * d if qkv else 0))
    inputs = R * (d + F + d + (d if qkv else 0))  # x, h, att, ln1
    grads = R * (d + F + d + (3 * d if qkv else 0))  # dy, dh, dproj, dqkv
    want = (L * weights + L * inputs + inputs + 2 * grads
            + (4 + SCALE_STRIDE) * L * len(TENSORS) + 4 * HISTORY * L * len(DELAYED) + 4)
    got = plan.totals()["fp8"]
    assert want <= got <= want + (28 + 12 * L) * 256  # buffers and slots rounded to 256 bytes
    plan.allocate(_FakeDrv())
    assert plan["fp8.next"] - plan["fp8.hist"] >= 4 * HISTORY * L * len(DELAYED)
    assert plan["fp8.w1t"] - plan["fp8.w1"] >= L * d * F
    assert plan["fp8.ht"] - plan["fp8.xt"] >= L * R * d
    for name in ("fp8.wqkv", "fp8.ln1t", "fp8.dqkvt"):
        if qkv:
            assert plan[name]
        else:
            with pytest.raises(KeyError):
                plan[name]


def test_the_blas_libraries_load_from_the_wheels_else_a_soname_else_say_what_was_tried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLAS and cuBLASLt through one loader (no GPU needed to check the order it tries)."""
    import ctypes
    import sys

    from engine.backends.cuda import cublas
    from engine.errors import RunError

    tried: list[str] = []

    def cdll(name: str) -> str:
        tried.append(name)
        if name == "libcublasLt.so.12":
            return "loaded " + name
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)  # no wheels: sonames only
    assert cublas.load_library("cublasLt", "cuBLASLt") == "loaded libcublasLt.so.12"
    assert tried == ["libcublasLt.so.13", "libcublasLt.so.12"]
    with pytest.raises(RunError) as e:
        cublas.load_library("cublas", "cuBLAS")
    msg = str(e.value)
    assert msg.startswith("cuBLAS library not found: cuda.pathfinder:")
    assert "libcublas.so.13: cannot open" in msg and "libcublas.so: cannot open" in msg


def test_every_cublaslt_call_has_its_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """ctypes passes Python ints as C ints unless told otherwise: every cuBLASLt function the
    two GEMM modules call is given its argument and result types when the library loads."""
    import re
    from pathlib import Path

    from engine.backends.cuda import cublaslt

    class Fn:
        argtypes: list | None = None
        restype = None

    class Lib:
        def __init__(self) -> None:
            self.fns: dict[str, Fn] = {}

        def __getattr__(self, name: str) -> Fn:
            return self.fns.setdefault(name, Fn())

    fake = Lib()
    monkeypatch.setattr(cublaslt, "load_library", lambda *a: fake)
    cublaslt.load_cublaslt.cache_clear()
    try:
        assert cublaslt.load_cublaslt() is fake
    finally:
        cublaslt.load_cublaslt.cache_clear()
    src = "".join(Path(cublaslt.__file__).with_name(n).read_text()
                  for n in ("cublaslt.py", "gemm.py"))
    called = set(re.findall(r"lib\.(cublasLt\w+)\b", src))
    assert called and all(fake.fns[n].argtypes is not None for n in called), called


def test_the_optimizer_kernels_read_the_hyper_parameters_where_the_host_puts_them():
    """kernels/optim.cu indexes the staged hyper-parameters by number: its constants and
    indices name the very slots of buffers.HP_FIELDS and UPD_WORDS."""
    import re

    from engine.backends.cuda import KERNEL_DIR
    from engine.backends.cuda.buffers import HP_FIELDS, UPD_WORDS

    src = (KERNEL_DIR / "optim.cu").read_text()
    define = {k: int(v) for k, v in re.findall(r"#define (HP_MAX_NORM|UPD_GC|UPD_SKIP) (\d+)", src)}
    assert define == {"HP_MAX_NORM": HP_FIELDS.index("max_norm"), "UPD_GC": len(HP_FIELDS),
                      "UPD_SKIP": len(HP_FIELDS) + 1}
    assert UPD_WORDS == len(HP_FIELDS) + 2
    # k_adamw_step: upd[0] .. upd[7] are lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_mult
    call = re.search(r"adamw_body\(p, p_lp, g, g_lp, m, v, seg_start, seg_decay, seg_qkv, "
                     r"seg_glp, nseg, d, "
                     r"begin, end, (upd\[\d\], ){8}upd\[UPD_GC\]\)", " ".join(src.split()))
    assert call, "k_adamw_step's call of adamw_body"
    assert HP_FIELDS[:8] == ("lr", "beta1", "beta2", "eps", "weight_decay", "bc1", "bc2",
                             "grad_mult")
    assert [int(i) for i in re.findall(r"upd\[(\d)\]", call.group(0))] == list(range(8))
    # k_step_hp: bc1, bc2 replaced by bc1_alt, bc2_alt when alt_if_skipped
    body = src[src.index("void k_step_hp"):]
    body = body[:body.index("\n}")]
    want = {f"hp[{HP_FIELDS.index(a)}] = hp[{HP_FIELDS.index(b)}]"
            for a, b in (("bc1", "bc1_alt"), ("bc2", "bc2_alt"))}
    assert want <= {" ".join(x.split()) for x in re.findall(r"hp\[\d+\] = hp\[\d+\]", body)}
    assert f"hp[{HP_FIELDS.index('alt_if_skipped')}] != 0.0f" in body


@pytest.mark.parametrize(("precision", "step"), [("bf16", 8), ("fp16", 8), ("fp32", 16)])
def test_adamw_wants_its_low_precision_copy_aligned_for_four(precision, step):
    """AdamW stores the low-precision copy 4 elements at a time (optim.cu store_lp): Ops refuses
    a params_lp not aligned for that before any launch, on both of its entry points."""
    from engine.backends.cuda.ops import Ops

    o = Ops({}, None, None, precision)
    launched: list[str] = []
    o._go = lambda name, *a, **k: launched.append(name)
    base = 1 << 20
    o.adamw(1, base, 2, 3, 4, 5, 6, 1, 64, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    o.adamw_step(1, base + step, 2, 3, 4, 5, 6, 1, 0, 64, 7)
    assert launched == ["k_adamw", "k_adamw_step"]
    for bad in (base + step // 2, base + 2):
        with pytest.raises(ValueError, match="not aligned"):
            o.adamw(1, bad, 2, 3, 4, 5, 6, 1, 64, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
        with pytest.raises(ValueError, match="not aligned"):
            o.adamw_step(1, bad, 2, 3, 4, 5, 6, 1, 0, 64, 7)
    assert launched == ["k_adamw", "k_adamw_step"]


def test_the_loss_kernels_want_rows_of_whole_octets():
    """kernels/loss.cu reads and writes a row 8 columns at a time: Ops refuses a logits row
    length that is not a multiple of 8, or shorter than V, before any launch."""
    from engine.backends.cuda.buffers import logits_ld
    from engine.backends.cuda.ops import Ops

    o = Ops({}, None, None, "bf16")
    launched: list[str] = []
    o._go = lambda name, *a, **k: launched.append(name)
    o._mm = lambda *a, **k: launched.append("gemm")
    o._writes = lambda *a: None
    args = (1, 2, 3, 4, 5, 6)
    o.loss_fwd(*args, 8, 1024, 8449, logits_ld(8449), 768, 8512, lp=True)
    assert launched == ["gemm", "k_loss_fwd_lp"]
    for V, ldv in ((8449, 8452), (8449, 8448), (301, 300)):
        with pytest.raises(ValueError, match="multiple of 8"):
            o.loss_fwd(*args, 8, 1024, V, ldv, 768, 8512)
        with pytest.raises(ValueError, match="multiple of 8"):
            o.loss_fwd_bwd(*args, 7, 8, 8, 1024, V, ldv, 768, 8512, lp=True)
        with pytest.raises(ValueError, match="multiple of 8"):
            o.loss_bwd(1, 2, 3, 4, 5, 6, 7, 8, 9, 8, 1024, V, ldv, 768, 8512)
    assert launched == ["gemm", "k_loss_fwd_lp"]
