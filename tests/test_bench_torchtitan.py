"""``python -m mxcomm.bench torchtitan``: torchtitan 0.3's MoE layer against mxcomm's (CPU).

The benchmark under ``torchrun`` at 2 gloo ranks, its defaults (tiny shapes, eager): it exits 0,
and mxcomm's variant meets torchao's SQNR targets against torchtitan's bf16 layer. The pieces
serially: the layer's config against torchtitan's DeepSeek-V3 671B config, the SQNR helper against
the NumPy one, how the integration is detected, and the exit status. Everything skips without
torchtitan.

Run: ``timeout 300 python -m pytest -q tests/test_bench_torchtitan.py`` (about 30 s on 2 cores).
"""

import inspect
import json
import math

import numpy
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan 0.3 is not installed (.ci/run installs it)")

from mxcomm.bench import torchtitan as bench  # noqa: E402
from torch_world import run_torchrun  # noqa: E402

# torch 2.11 (the GPU machines' image) lacks names torchtitan 0.3's DeepSeek-V3 package imports:
# the benchmark's stand-ins, as its runs install them, before that package is imported
bench._guard_torch()
pytest.importorskip("torchtitan.models.deepseek_v3",
                    reason="torchtitan 0.3 is not installed (.ci/run installs it)")


def test_benchmark_under_torchrun_mxcomm_meets_the_sqnr_targets(tmp_path):
    """``torchrun --nproc-per-node 2 -m mxcomm.bench torchtitan --mxcomm-recipe mxfp8`` on the
    CPU: exit status 0, both variants timed, float8 skipped with its reason, mxcomm's SQNR >= 28 /
    26 / 25 dB and finite. (The recipe is pinned: "auto" chooses bf16 on a CPU, whose SQNR is
    infinite wherever the integration takes recipes: a check that quantization could fail.)"""
    path = tmp_path / "titan.json"
    returncode, stdout, stderr = run_torchrun(
        ["mxcomm.bench", "torchtitan", "--mxcomm-recipe", "mxfp8", "--json", str(path)])
    assert returncode == 0, stderr[-3000:]
    assert stdout.startswith("torchtitan's MoE layer (DeepSeek-V3 671B config), 2 ranks on a CPU")
    result = json.loads(path.read_text())
    meta, tables = result["meta"], result["tables"]
    assert meta["world_size"] == 2 and meta["modes"] == ["eager"]
    assert meta["shapes"] == [dict(zip(("tokens", "dim", "hidden", "e_local"), bench.HOST_SHAPE))]
    assert meta["mxcomm_recipe"] == "mxfp8" and len(meta["mxcomm_integration"]) == 1
    assert any(n.startswith("torchtitan_float8 skipped") for n in meta["notes"])
    runs = {(r["variant"], r["mode"]): r for r in tables["runs"]}
    assert set(runs) == {("torchtitan_bf16", "eager"), ("mxcomm", "eager")}
    assert (runs["mxcomm", "eager"]["recipe"], runs["torchtitan_bf16", "eager"]["recipe"]) == \
        ("mxfp8", "")
    for r in runs.values():
        assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(64 / (r["ms"] * 1e-3))
        assert r["peak_gb"] is None  # n/a on a CPU (NaN in JSON: null)
    (row,) = tables["sqnr"]
    assert (row["variant"], row["mode"], row["ok"]) == ("mxcomm", "eager", "yes")
    for key, target in bench.SQNR_TARGETS.items():
        value = row[f"{key}_db"]
        assert value != "inf" and value >= target, (key, value)
    # w1, w2, w3 alone: on every rank all three together are a weighted mean of them, so the
    # weakest (minimum over ranks) is no better than the together's minimum over ranks
    each = row["weight_grad_each_db"]
    assert len(each) == 3 and min(each) <= row["weight_grad_db"], each
    assert "SQNR vs torchtitan_bf16" in stdout


def test_moe_config_is_the_flavor_layer_at_the_shape():
    """The 671B layer's router settings and shared expert at the benchmark's dims; its node-limited
    routing kept where the experts form its groups, dropped (with a note) where they cannot."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    layer = bench.flavor_layer()
    router = layer.router
    assert (router.top_k, router.score_func, router.route_norm, router.route_scale) == \
        (8, "sigmoid", True, 2.5)
    shapes = bench.shapes_from_args(_args(), True, layer)
    assert [(s.tokens, s.dim, s.hidden, s.e_local) for s in shapes] == \
        [(4096, 7168, 2048, 8), (16384, 7168, 2048, 8)]
    config, notes = bench.moe_config(layer, bench.Shape(32, 64, 32, 8), 2)
    assert notes == []
    assert (config.num_experts, config.router.num_experts, config.router.top_k) == (16, 16, 8)
    assert (config.router.num_expert_groups, config.router.num_limited_groups) == (8, 4)
    assert (config.router.gate.in_features, config.router.gate.out_features) == (64, 16)
    inner = config.routed_experts.inner_experts
    assert (inner.dim, inner.hidden_dim, inner.num_experts) == (64, 32, 8)
    dispatcher = config.routed_experts.token_dispatcher
    assert type(dispatcher) is AllToAllTokenDispatcher.Config
    assert (dispatcher.num_experts, dispatcher.top_k) == (16, 8)
    assert (config.shared_experts.w1.in_features, config.shared_experts.w1.out_features) == (64, 32)
    config, notes = bench.moe_config(layer, bench.Shape(32, 64, 32, 4), 2)
    assert config.router.num_expert_groups is None and "dropped" in notes[0]
    with pytest.raises(ValueError, match="--experts: .* picks 8 experts .* 2 x 2 = 4"):
        bench.moe_config(layer, bench.Shape(32, 64, 32, 2), 2)


def _args(**given):
    values = dict(tokens=None, dim=None, hidden=None, experts=None)
    values.update(given)
    return type("Args", (), values)()


def _numpy_sqnr(ref, out):  # an independent reference: 20 log10(||ref|| / ||ref - out||)
    ref, out = numpy.asarray(ref, numpy.float64), numpy.asarray(out, numpy.float64)
    return 20 * math.log10(numpy.linalg.norm(ref) / numpy.linalg.norm(ref - out))


def test_sqnr_of_tensor_lists_matches_numpy():
    g = torch.Generator().manual_seed(5)
    refs = [torch.randn(7, 33, generator=g), torch.randn(2, 3, 5, generator=g)]
    outs = [r + 0.01 * torch.randn(r.shape, generator=g) for r in refs]
    joined = [numpy.concatenate([t.numpy().ravel() for t in ts]) for ts in (refs, outs)]
    assert bench.sqnr(refs, [o.bfloat16() for o in outs]) == pytest.approx(
        _numpy_sqnr(joined[0], numpy.concatenate([o.bfloat16().float().numpy().ravel()
                                              for o in outs])), abs=1e-9)
    assert bench.sqnr(refs, outs) == pytest.approx(_numpy_sqnr(*joined), abs=1e-9)
    assert bench.sqnr(refs, refs) == math.inf
    bad = [refs[0].clone(), refs[1]]
    bad[0][3, 4] = float("nan")
    assert math.isnan(bench.sqnr(refs, bad))
    assert math.isnan(bench.sqnr([torch.zeros(2, 4)], [torch.ones(2, 4)]))
    with pytest.raises(ValueError, match=r"out: expected shape \(7, 33\)"):
        bench.sqnr(refs[:1], [refs[0][:3]])
    with pytest.raises(ValueError, match="outs: expected 2 tensors"):
        bench.sqnr(refs, refs[:1])


def test_integration_detected_by_its_signature(monkeypatch):
    """A recipe where ``use_mxcomm`` takes ``recipe=``; "auto" where it accepts it, else resolved
    by the chooser for the shape's rows; the recipe's precisions where it takes no recipe."""
    import mxcomm.integrations.torchtitan as integration
    from mxcomm.recipes import get_recipe

    def with_recipe(config, *, recipe=None):
        return 1

    def refusing_auto(config, *, recipe=None):
        if recipe == "auto":
            raise ValueError("recipe: 'auto' chooses per layout")
        return 1

    def without(config, *, dispatch_precision="mxfp8", combine_precision="bf16"):
        return 1

    def call(recipe, rows=4096, device="sm90"):
        return bench.mxcomm_integration(recipe, object(), rows, 7168, 2048, device)

    monkeypatch.setattr(integration, "use_mxcomm", with_recipe)
    assert call("auto") == ({"recipe": "auto"}, "auto", 'use_mxcomm(config, recipe="auto")')
    assert call("mxfp8")[:2] == ({"recipe": "mxfp8"}, "mxfp8")
    monkeypatch.setattr(integration, "use_mxcomm", refusing_auto)
    # the H100 table's points (mxcomm.recipes.H100_TABLE): fp8_rowwise at 131072 rows on SM90,
    # mxfp8 where no fp8 GEMM runs, bf16 at 4096 rows and always on the CPU
    for rows, device, chosen in ((131072, "sm90", "fp8_rowwise"), (131072, "cuda", "mxfp8"),
                                 (4096, "sm90", "bf16"), (131072, "cpu", "bf16")):
        keywords, shown, text = call("auto", rows, device)
        assert (keywords, shown) == ({"recipe": chosen}, f"auto ({chosen})"), (rows, device)
        assert "refuses" in text and device in text
    assert call("fp8_rowwise")[:2] == ({"recipe": "fp8_rowwise"}, "fp8_rowwise")
    monkeypatch.setattr(integration, "use_mxcomm", without)
    keywords, shown, text = call("auto")
    assert (keywords, shown) == ({}, "auto (defaults)") and "takes no recipe=" in text
    keywords, shown, text = call("mxfp8")
    r = get_recipe("mxfp8")
    assert keywords == dict(dispatch_precision=r.dispatch, combine_precision=r.combine,
                            dispatch_grad_precision=r.dispatch_grad,
                            combine_grad_precision=r.combine_grad)
    assert shown == "mxfp8" and "takes no recipe=" in text


def test_exit_status_follows_mxcomm_rows_only():
    row = {"shape": "s", "mode": "eager", "ok": "yes"}
    assert not bench.failed({"sqnr": [dict(row, variant="mxcomm")]})
    assert bench.failed({"sqnr": [dict(row, variant="mxcomm", ok="no")]})
    assert not bench.failed({"sqnr": [dict(row, variant="torchtitan_float8", ok="no")]})
    raised = {"shape": "s", "tokens": 64, "mode": "compiled", "error": "rank 1: RuntimeError: x"}
    assert bench.failed({"sqnr": [], "failures": [dict(raised, variant="mxcomm")]})
    assert not bench.failed({"sqnr": [], "failures": [dict(raised, variant="torchtitan_float8")]})
    meta = bench._report.metadata("torchtitan", 2, [])
    text = bench.render(meta, {"runs": [], "sqnr": [], "failures": [dict(raised, variant="x")]})
    assert "runs that raised" in text and "rank 1: RuntimeError: x" in text


def test_cli_rejects_bad_sizes_in_one_line(capsys):
    from mxcomm.bench import _cli
    assert _cli.main(["torchtitan", "--dim", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("python -m mxcomm.bench torchtitan: error: --dim: expected a multiple of 32 "
                   "(MXFP8 blocks of 32 elements), got 100")
    assert _cli.main(["torchtitan", "--tokens", "64", "0"]) == 2
    assert "--tokens: expected positive values, got 0" in capsys.readouterr().err


def test_float8_needs_an_sm90_gpu():
    assert "need an SM90 GPU, this is a CPU" in bench.float8_unavailable(torch.device("cpu"))


def test_report_fits_120_columns():
    """The widest rows a GPU run makes (float8, a chosen recipe, 4-digit ms, a long error)."""
    row = {"shape": "16384x7168x2048x8", "tokens": 16384, "variant": "torchtitan_float8",
           "recipe": "", "mode": "compiled", "ms": 1234.5, "tokens_per_s": 1234567.0,
           "speedup": 1.23, "peak_gb": 71.2, "peak_above_start_gb": 40.1}
    sqnr = {"shape": row["shape"], "tokens": 16384, "variant": "mxcomm",
            "recipe": "auto (fp8_rowwise)", "mode": "compiled", "out_db": 31.2,
            "input_grad_db": 30.1, "weight_grad_db": 26.2, "ok": "yes"}
    raised = {"shape": row["shape"], "tokens": 16384, "variant": "torchtitan_float8",
              "mode": "compiled", "error": "rank 0: RuntimeError: " + "word " * 60}
    tables = {"runs": [row, dict(row, variant="mxcomm", recipe="auto (fp8_rowwise)")],
              "sqnr": [sqnr], "failures": [raised]}
    text = bench.render(bench._report.metadata("torchtitan", 2, []), tables)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "auto (fp8_rowwise)" in text and "1234567" in text and "1.23x" in text
