"""torchtitan 0.3's own MoE layer with mxcomm's dispatcher (``mxcomm.integrations.torchtitan``).

Two spawned gloo ranks (``tests/torch_world.py``) build torchtitan's ``MoE`` (router, experts,
token dispatcher) with 2 local experts each, the same weights for every variant, and run forward
and backward. The reference is torchtitan's default ``AllToAllTokenDispatcher`` (torch's all-to-all;
under its DTensor spmd backend: its spmd_types exchange sends uneven splits through gloo's
``alltoall``, which takes equal ones only, so it cannot run on a CPU). mxcomm's dispatcher runs
under both spmd backends: at ``"native"`` (fp32 and bf16 models) and ``"bf16"`` (bf16 models) its
output, input gradient, router and expert weight gradients are bit-identical to the reference; at
``"mxfp8"`` (both directions) and at the default (``"mxfp8"`` dispatch, ``"bf16"`` combine) they
are within SQNR >= 25 dB of it (bf16 model). Serial tests cover the
config conversion, torchtitan's override mechanism and the torchtitan 0.2.x patch. Everything
skips if torchtitan is not installed.

Run: ``python -m pytest -q tests/test_torchtitan.py`` (part of the serial suite).
"""

import importlib
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan.models.common.token_dispatcher",
                    reason="torchtitan 0.3 is not installed (.ci/run installs it)")

from mxcomm import sqnr  # noqa: E402
from torch_world import run_world  # noqa: E402

E_LOCAL, DIM, HIDDEN, TOP_K, BATCH, SEQ = 2, 256, 64, 2, 4, 32
SQNR_DB = 25.0
SEED = 77


def _moe(num_experts, dispatcher):
    """torchtitan's MoE layer holding ``E_LOCAL`` of ``num_experts`` experts, no load balancing."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (MoE, GroupedExperts, RoutedExperts,
                                              TokenChoiceTopKRouter)
    return MoE.Config(
        num_experts=num_experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN,
                                                num_experts=E_LOCAL),
            token_dispatcher=dispatcher),
        router=TokenChoiceTopKRouter.Config(
            num_experts=num_experts, top_k=TOP_K,
            gate=Linear.Config(in_features=DIM, out_features=num_experts))).build()


def _weights(rank, size):
    """Every rank's share of one global set of weights (seeded alike everywhere)."""
    g = torch.Generator().manual_seed(SEED)
    experts = E_LOCAL * size
    mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    w1 = torch.randn(experts, HIDDEN, DIM, generator=g) * DIM ** -0.5
    w2 = torch.randn(experts, DIM, HIDDEN, generator=g) * HIDDEN ** -0.5
    w3 = torch.randn(experts, HIDDEN, DIM, generator=g) * DIM ** -0.5
    gate = torch.randn(experts, DIM, generator=g) * DIM ** -0.5
    return {"routed_experts.inner_experts.w1_EFD": w1[mine],
            "routed_experts.inner_experts.w2_EDF": w2[mine],
            "routed_experts.inner_experts.w3_EFD": w3[mine], "router.gate.weight": gate}


def _run(dispatcher, backend, dtype, rank, size, mesh):
    """Forward and backward of the MoE layer; its output and gradients (float32 copies)."""
    from torchtitan.distributed import utils as titan_utils
    titan_utils.set_spmd_backend(backend)
    device = mesh.device_type
    moe = _moe(E_LOCAL * size, dispatcher)
    moe.load_state_dict(_weights(rank, size), strict=False)
    moe.to(device=device, dtype=dtype)
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    g = torch.Generator().manual_seed(SEED + 1 + rank)
    x = torch.randn(BATCH, SEQ, DIM, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(BATCH, SEQ, DIM, generator=g).to(device, dtype)
    out = moe(x)
    out.backward(grad)
    named = dict(moe.named_parameters())
    result = {"output": out, "input grad": x.grad}
    result.update({f"{name} grad": p.grad for name, p in named.items()})
    return {k: v.detach().float().clone() for k, v in result.items()}


def moe_checks(rank, size, device="cpu"):
    """Every variant against the reference on this rank; returns the SQNRs of the MXFP8 ones.

    On a CPU the reference of both spmd backends is the DTensor one's (torchtitan's spmd_types
    exchange cannot run on gloo); on GPUs each backend has its own.
    """
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        # torchtitan 0.3.0's dispatcher asks it (torch >= 2.12); the GPU image has torch 2.11.
        # Outside any tracing, which is where these tests run, its answer is False.
        torch.compiler._is_non_strict_tracing = lambda: False
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.spmd_types import set_spmd_meshes
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from mxcomm.integrations.torchtitan import MxcommTokenDispatcher
    mesh = init_device_mesh(device, (size,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    experts = E_LOCAL * size
    torchtitans = AllToAllTokenDispatcher.Config(num_experts=experts, top_k=TOP_K)

    def mxcomm(dispatch, combine):
        return MxcommTokenDispatcher.Config(num_experts=experts, top_k=TOP_K,
                                            dispatch_precision=dispatch,
                                            combine_precision=combine)

    sqnrs = {}
    for dtype in (torch.float32, torch.bfloat16):
        references = {"full_dtensor": _run(torchtitans, "full_dtensor", dtype, rank, size, mesh)}
        references["spmd_types"] = references["full_dtensor"] if device == "cpu" else \
            _run(torchtitans, "spmd_types", dtype, rank, size, mesh)
        for backend, reference in references.items():
            assert reference["output"].abs().sum() > 0
            # bf16 on the wire is lossless for bf16 activations only (fp32 ones are rounded)
            for precision in ("native", "bf16") if dtype == torch.bfloat16 else ("native",):
                got = _run(mxcomm(precision, precision), backend, dtype, rank, size, mesh)
                assert got.keys() == reference.keys()
                for key in reference:
                    assert torch.equal(got[key], reference[key]), \
                        f"{precision} under {backend}, {dtype}: {key} differs"
            if dtype != torch.bfloat16:
                continue
            for variant in (("mxfp8", "mxfp8"), ("mxfp8", "bf16")):
                got = _run(mxcomm(*variant), backend, dtype, rank, size, mesh)
                sqnrs[(backend, variant)] = {k: sqnr(reference[k], got[k]) for k in reference
                                             if k == "output" or k == "input grad" or "inner"
                                             in k}
    return sqnrs


# ------------------------------------------------------------------------------------- tests
def _check_sqnrs(results):
    for rank_sqnrs in results:
        assert rank_sqnrs
        for (backend, variant), values in rank_sqnrs.items():
            low = {k: round(v, 2) for k, v in values.items() if not v >= SQNR_DB}
            assert not low, f"{variant} under {backend}: SQNR below {SQNR_DB} dB: {low}"


def test_torchtitan_moe_layer_native_bf16_exact_mxfp8_sqnr():
    _check_sqnrs(run_world(2, moe_checks, timeout=240))


@pytest.mark.gpu
def test_torchtitan_moe_layer_on_two_gpus():
    """The same on 2 GPUs over NCCL (mxcomm's NCCL communicator, bootstrapped over the EP
    group; each spmd backend against its own reference)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_sqnrs(run_world(2, moe_checks, "cuda", timeout=600, gpu=True))


def test_config_conversion_and_override():
    """``use_mxcomm`` and torchtitan's override swap the dispatcher configs (TorchAO's keeps
    its padding); an unknown precision fails at configuration time."""
    from torchtitan.models.common.token_dispatcher import (AllToAllTokenDispatcher,
                                                           TorchAOTokenDispatcher)

    import mxcomm.integrations.torchtitan as tt
    moe = _moe_config(AllToAllTokenDispatcher.Config(num_experts=4, top_k=2))
    assert tt.use_mxcomm(moe, dispatch_precision="native", combine_precision="bf16") == 1
    swapped = moe.routed_experts.token_dispatcher
    assert type(swapped) is tt.MxcommTokenDispatcher.Config
    assert (swapped.num_experts, swapped.top_k, swapped.dispatch_precision,
            swapped.combine_precision) == (4, 2, "native", "bf16")
    built = swapped.build()
    assert type(built) is tt.MxcommTokenDispatcher
    assert (built.dispatch_grad_precision, built.combine_grad_precision) == ("bf16", "native")
    padded = tt.mxcomm_token_dispatcher(
        TorchAOTokenDispatcher.Config(num_experts=4, top_k=2, pad_multiple=32))
    assert type(padded) is tt.MxcommTorchAOTokenDispatcher.Config and padded.pad_multiple == 32
    with pytest.raises(ValueError, match="combine_precision"):
        tt.use_mxcomm(moe, combine_precision="fp4")
    # torchtitan's override machinery imports the module by name and applies the factory
    overrides = importlib.import_module("torchtitan.config.override")
    moe = _moe_config(AllToAllTokenDispatcher.Config(num_experts=4, top_k=2))
    log = overrides.apply_overrides(overrides.OverrideConfig(imports=[(
        "mxcomm.integrations.torchtitan.mxcomm_token_dispatcher",
        {"dispatch_precision": "mxfp8", "combine_precision": "mxfp8"})]), moe)
    assert len(log) == 1 and "MxcommTokenDispatcher" in log[0]
    assert moe.routed_experts.token_dispatcher.combine_precision == "mxfp8"


def _moe_config(dispatcher):
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (MoE, GroupedExperts, RoutedExperts,
                                              TokenChoiceTopKRouter)
    return MoE.Config(
        num_experts=4, routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=32, hidden_dim=16, num_experts=2),
            token_dispatcher=dispatcher),
        router=TokenChoiceTopKRouter.Config(num_experts=4, top_k=2, gate=Linear.Config(
            in_features=32, out_features=4)))


def test_torchtitan_0_2_patch(monkeypatch):
    """torchtitan 0.2.x's ExpertParallel reads ``all_to_all_single_autograd`` from its module:
    the patch puts a function with torch's signature there, and returns the old one."""
    import mxcomm.integrations.torchtitan as tt
    original = object()
    ep = types.ModuleType("torchtitan.distributed.expert_parallel")
    ep.all_to_all_single_autograd = original
    monkeypatch.setitem(sys.modules, "torchtitan.distributed.expert_parallel", ep)
    monkeypatch.setattr(importlib.import_module("torchtitan.distributed"), "expert_parallel", ep,
                        raising=False)
    assert tt.patch_expert_parallel("bf16") is original
    patched = ep.all_to_all_single_autograd
    assert patched.precision == "bf16"
    assert list(__import__("inspect").signature(patched).parameters) == [
        "input", "output_split_sizes", "input_split_sizes", "group", "tag"]


# --------------------------------------------------- recipes, mxcomm's permute, torch.compile
#: A recipe as ``mxcomm.recipes`` gives it (``use_mxcomm`` reads these fields): today's
#: ``fp8_rowwise``.
FP8_ROWWISE = types.SimpleNamespace(name="fp8_rowwise", dispatch="fp8_rowwise", combine="bf16",
                                    dispatch_grad="bf16", combine_grad="fp8_rowwise",
                                    gemm="fp8", fused=True)


def _recipe_moe(num_experts, recipe, **keywords):
    """torchtitan's MoE config (as :func:`_moe`) with mxcomm installed by ``use_mxcomm``."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (MoE, GroupedExperts, RoutedExperts,
                                              TokenChoiceTopKRouter)
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from mxcomm.integrations.torchtitan import use_mxcomm
    config = MoE.Config(
        num_experts=num_experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN,
                                                num_experts=E_LOCAL),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=num_experts,
                                                            top_k=TOP_K)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=num_experts, top_k=TOP_K,
            gate=Linear.Config(in_features=DIM, out_features=num_experts)))
    assert use_mxcomm(config, recipe=recipe, **keywords) == 1
    return config


def _layer_step(moe, rank):
    """Forward and backward of a built MoE layer (bf16); output and gradients, float32."""
    g = torch.Generator().manual_seed(SEED + 1 + rank)
    device = next(moe.parameters()).device
    x = torch.randn(BATCH, SEQ, DIM, generator=g).to(device, torch.bfloat16).requires_grad_()
    grad = torch.randn(BATCH, SEQ, DIM, generator=g).to(device, torch.bfloat16)
    out = moe(x)
    out.backward(grad)
    result = {"output": out, "input grad": x.grad}
    result.update({f"{name.removeprefix('_orig_mod.')} grad": p.grad  # compiled: the module's
                   for name, p in moe.named_parameters()})
    return {k: v.detach().float().clone() for k, v in result.items()}


def _built(config, rank, size, mesh):
    moe = config.build()
    moe.load_state_dict(_weights(rank, size), strict=False)
    moe.to(device=mesh.device_type, dtype=torch.bfloat16)
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe


def recipe_checks(rank, size, device="cpu"):
    """torchtitan's MoE layer with mxcomm's fp8 rowwise recipe (mxcomm permutes; fp8 rows to
    the experts): eager against torchtitan's bf16 dispatcher (SQNR), and compiled with
    ``fullgraph=True`` against eager (bit for bit), counting mxcomm's exchanges."""
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        # torchtitan 0.3.0's reference dispatcher asks it (torch >= 2.12); the GPU image has
        # torch 2.11, with no non-strict tracing to ask about
        torch.compiler._is_non_strict_tracing = lambda: False
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import set_spmd_meshes
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    import mxcomm.integrations.torchtitan as tt
    from mxcomm.torch import _ops
    titan_utils.set_spmd_backend("full_dtensor")
    mesh = init_device_mesh(device, (size,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    experts = E_LOCAL * size
    reference = _run(AllToAllTokenDispatcher.Config(num_experts=experts, top_k=TOP_K),
                     "full_dtensor", torch.bfloat16, rank, size, mesh)
    import mxcomm.torch as mt
    ran, seen = [], []
    real, real_mm = _ops._exchange, mt.grouped_mm

    def counted(function, *args):
        ran.append(function)
        return real(function, *args)

    def grouped_mm(x, w, offs, **options):  # what the experts' GEMMs are given
        seen.append((type(x).__name__, len(w) if isinstance(w, tuple) else 1))
        return real_mm(x, w, offs, **options)

    _ops._exchange = counted
    import mxcomm._torch_gemm as gemm_module  # where mxcomm's experts look it up, per call
    mt.grouped_mm = gemm_module.grouped_mm = grouped_mm
    from torchtitan.models.common import token_dispatcher as td

    def torchs(*args, **kwargs):
        raise AssertionError("torchtitan's own exchange ran in place of mxcomm's")

    td.all_to_all_single = torchs  # from here on, only mxcomm's exchanges may run
    config = _recipe_moe(experts, FP8_ROWWISE)
    dispatcher = config.routed_experts.token_dispatcher
    assert type(dispatcher) is tt.MxcommTokenDispatcher.Config and dispatcher.permute_align == 32
    assert type(config.routed_experts.inner_experts) is tt.MxcommGroupedExperts.Config
    eager = _layer_step(_built(config, rank, size, mesh), rank)
    eager_ran, eager_seen = sorted(ran), list(seen)
    ran.clear()
    seen.clear()
    torch._dynamo.config.capture_scalar_outputs = True
    moe = _built(config, rank, size, mesh)
    compiled = _layer_step(torch.compile(moe, fullgraph=True, backend="aot_eager"), rank)
    sqnrs = {k: sqnr(reference[k].float(), eager[k].float()) for k in reference
             if k == "output" or k == "input grad" or "inner" in k}
    equal = {k: torch.equal(eager[k], compiled[k]) for k in eager}
    return sqnrs, equal, eager_ran, sorted(ran), eager_seen, seen


def test_torchtitan_recipe_fp8_rows_to_experts_eager_and_compiled():
    """``use_mxcomm(recipe=fp8_rowwise)``: the dispatcher permutes in mxcomm's exchange and its
    fp8 rowwise rows (a QuantizedTensor) reach the experts' GEMMs as they arrive; output and
    gradients within SQNR >= 25 dB of torchtitan's bf16 dispatcher; ``torch.compile(
    fullgraph=True)`` of the layer delivers the same QuantizedTensor rows to the experts, equals
    eager bit for bit (on a CPU the fp8 GEMM is the bf16 fallback) and makes mxcomm's 4
    exchanges (torchtitan's own all-to-all is made to raise)."""
    _check_recipe(run_world(2, recipe_checks, timeout=600))


@pytest.mark.gpu
def test_gpu_torchtitan_recipe_eager_and_compiled():
    """The same on 2 GPUs over NCCL: the fp8 rows feed the SM90 fp8 grouped GEMM as they arrive,
    eager and compiled (the GEMM op given their data and scales)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_recipe(run_world(2, recipe_checks, "cuda", timeout=600, gpu=True), sqnr_known_low=True)


def _check_recipe(results, sqnr_known_low=False):
    """Every check but the SQNR targets strictly; those too, except where ``sqnr_known_low``:
    the fp8 GEMMs of torchtitan's layer on SM90 measured below them (input grad 23.4 dB, expert
    weight grads 24.0-24.5 dB on 2xH100 at 194096a, 2026-11-27; bench/NOTES.md), an open target
    of the recipe, reported as an expected failure with the numbers of this run."""
    lows = []
    expected = sorted(["a2a_dispatch", "a2a_combine", "a2a_combine_backward",
                       "a2a_dispatch_backward"])
    for rank, (sqnrs, equal, eager_ran, compiled_ran, eager_seen, compiled_seen) in enumerate(
            results):
        low = {k: round(v, 2) for k, v in sqnrs.items() if not v >= SQNR_DB}
        assert sqnr_known_low or not low, f"rank {rank}: SQNR below {SQNR_DB} dB: {low}"
        if low:
            lows.append(f"rank {rank}: {low}")
        assert all(equal.values()), f"rank {rank}: compiled differs from eager: {equal}"
        assert eager_ran == compiled_ran == expected, (rank, eager_ran, compiled_ran)
        # one GEMM over w1|w3 reads the delivered fp8 rows, w2 the SwiGLU's bf16 product;
        # compiled too (what the traced code saw: a QuantizedTensor made in the graph)
        assert eager_seen == [("QuantizedTensor", 2), ("Tensor", 1)], eager_seen
        assert compiled_seen == eager_seen, compiled_seen
    if lows:
        pytest.xfail(f"SQNR below {SQNR_DB} dB (the recipe's open target): {'; '.join(lows)}")


def overlap_checks(rank, size, device="cpu"):
    """torchtitan's layer with the fp8_rowwise recipe and ``use_mxcomm(..., overlap=True)``,
    eager: output and gradients against ``overlap=False`` bit for bit, and the dispatcher's
    overlap counters; then the same with the experts' three GEMMs of before (w1 and w3 each a
    ``grouped_mm``: the rows' gradient a sum autograd makes after both)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    import mxcomm.integrations.torchtitan as tt
    import mxcomm.torch as mt
    titan_utils.set_spmd_backend("full_dtensor")
    mesh = init_device_mesh(device, (size,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    experts = E_LOCAL * size
    results, counters = {}, {}
    for case in ("overlap", "no overlap", "three GEMMs"):
        if case == "three GEMMs":
            cls = tt.MxcommGroupedExperts
            cls._uses_mxcomm_gemm = lambda self, x: False
            cls._grouped_mm = lambda self, *, A, B_t, offs: mt.grouped_mm(A, B_t, offs)
        config = _recipe_moe(experts, FP8_ROWWISE, overlap=case != "no overlap")
        moe = _built(config, rank, size, mesh)
        results[case] = _layer_step(moe, rank)
        overlap = moe.routed_experts.token_dispatcher.backward_overlap
        counters[case] = None if overlap is None else (overlap.beside, overlap.behind)
    equal = {case: all(torch.equal(results[case][k], results["no overlap"][k])
                       for k in results[case]) for case in ("overlap",)}
    return equal, counters


def test_torchtitan_recipe_overlap_engages():
    """``use_mxcomm(recipe=fp8_rowwise, overlap=True)`` in torchtitan's MoE layer (2 gloo ranks,
    eager): the same output and gradients as without overlap, bit for bit, and the dispatch's
    backward waited for the experts' dgrad mark only (``beside`` 1, ``behind`` 0: on a GPU the
    gradient exchange runs beside the wgrad); with the experts' former three GEMMs it waits
    for everything (``behind`` 1), which is what the one w1|w3 GEMM changes. ``overlap`` where
    mxcomm does not permute, or not a bool, raises ValueError."""
    import mxcomm.integrations.torchtitan as tt
    for rank, (equal, counters) in enumerate(run_world(2, overlap_checks, timeout=600)):
        assert all(equal.values()), (rank, equal)
        assert counters == {"overlap": (1, 0), "no overlap": None, "three GEMMs": (0, 1)}, \
            (rank, counters)
    plain = types.SimpleNamespace(**dict(vars(FP8_ROWWISE), fused=False, gemm="bf16"))
    with pytest.raises(ValueError, match="overlap: expected None, False, or True with a recipe"):
        _recipe_moe(4, plain, overlap=True)
    with pytest.raises(ValueError, match="overlap: expected None, False"):
        _recipe_moe(4, FP8_ROWWISE, overlap="yes")
    config = _recipe_moe(4, FP8_ROWWISE, overlap=True)
    assert config.routed_experts.token_dispatcher.overlap is True
    assert type(config.routed_experts.inner_experts) is tt.MxcommGroupedExperts.Config
    # the default: on with the fp8 GEMM's recipe and "auto", off with a bf16 GEMM's
    for recipe, on in ((FP8_ROWWISE, True), ("auto", True), (plain, False), ("mxfp8", False)):
        config = _recipe_moe(4, recipe)
        assert config.routed_experts.token_dispatcher.overlap is on, recipe


def weight_grad_checks(rank, size):
    """torchtitan's layer, eager, with the fp8 GEMMs of SM90 emulated in float64
    (``reference_gemm.scaled_grouped_mm_float64``): the SQNR of each expert weight gradient
    (w1, w2, w3) and of all three together against torchtitan's bf16 layer, for the recipes
    ``fp8_rowwise`` and ``fp8_rowwise_gradbf16`` (its output gradient in bf16 on the wire)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import set_spmd_meshes
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from mxcomm import _torch_gemm, recipes
    from reference_gemm import scaled_grouped_mm_float64 as _emulated_scaled_grouped_mm
    titan_utils.set_spmd_backend("full_dtensor")
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    experts = E_LOCAL * size
    reference = _run(AllToAllTokenDispatcher.Config(num_experts=experts, top_k=TOP_K),
                     "full_dtensor", torch.bfloat16, rank, size, mesh)
    _torch_gemm.fp8_gemm_available = lambda device: True
    torch._scaled_grouped_mm = _emulated_scaled_grouped_mm
    names = [f"routed_experts.inner_experts.{w} grad" for w in ("w1_EFD", "w2_EDF", "w3_EFD")]
    found = {}
    for name in ("fp8_rowwise", "fp8_rowwise_gradbf16"):
        got = _layer_step(_built(_recipe_moe(experts, recipes.get_recipe(name)), rank, size,
                                 mesh), rank)
        found[name] = [sqnr(reference[k], got[k]) for k in names] + [
            sqnr(torch.cat([reference[k].flatten() for k in names]),
                 torch.cat([got[k].flatten() for k in names]))]
    return found


def test_torchtitan_weight_gradients_of_the_fp8_recipes():
    """The fp8_rowwise recipe's expert weight gradients with the GEMMs fp8 as on SM90
    (emulated) against torchtitan's bf16 layer, 2 gloo ranks: below the 25 dB target together
    (as 2xH100 measured at f5abc18: 24.1 dB); ``fp8_rowwise_gradbf16`` (the output gradient
    in bf16 on the wire, the w1|w3 weight gradient's GEMM in bf16, the forward and dgrads
    fp8 as before) gains on every weight and meets it together on every rank.
    bench/probe_wgrad.py measures the same at the 671B layer's proportions (24.1 -> 26.0 dB
    together)."""
    for rank, found in enumerate(run_world(2, weight_grad_checks, timeout=600)):
        base, option = found["fp8_rowwise"], found["fp8_rowwise_gradbf16"]
        print(f"rank {rank}: w1 w2 w3 together, dB: fp8_rowwise "
              f"{[round(v, 2) for v in base]}, fp8_rowwise_gradbf16 "
              f"{[round(v, 2) for v in option]}")
        assert base[3] < SQNR_DB <= option[3], (rank, base, option)
        assert all(o > b + 0.3 for o, b in zip(option, base)), (rank, base, option)


@pytest.mark.gpu
def test_gpu_torchtitan_recipe_overlap_engages():
    """The same on 2 GPUs over NCCL, with real side streams: bit for bit against no overlap
    (a race between the side stream's exchange and the wgrad would show as other bits), and
    the counters as on the CPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for rank, (equal, counters) in enumerate(run_world(2, overlap_checks, "cuda", timeout=600,
                                                       gpu=True)):
        assert all(equal.values()), (rank, equal)
        assert counters == {"overlap": (1, 0), "no overlap": None, "three GEMMs": (0, 1)}, \
            (rank, counters)


def test_override_registered_when_imported_before_torchtitan():
    """Importing the integration before torchtitan's config still registers its overrides (a
    fresh interpreter: the order of imports is what is tested)."""
    import os
    import subprocess
    code = ("import mxcomm.integrations.torchtitan\n"
            "import importlib\n"
            "overrides = importlib.import_module('torchtitan.config.override')\n"
            "names = set(overrides._REGISTRY)\n"
            "print(sorted(n for n in names if n.startswith('mxcomm.')))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] +
        os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "mxcomm.integrations.torchtitan.mxcomm_token_dispatcher" in out.stdout, out.stdout
    assert "mxcomm.integrations.torchtitan.mxcomm_moe" in out.stdout, out.stdout


def test_recipe_config_and_override():
    """``use_mxcomm(recipe=...)`` and the ``mxcomm_moe`` override install the dispatcher (with
    mxcomm's permute where the recipe is fused) and the experts class; ``"auto"`` installs the
    per-call choice with the experts' width (not on TorchAO's dispatcher, which says why)."""
    import mxcomm.integrations.torchtitan as tt
    config = _recipe_moe(4, FP8_ROWWISE)
    dispatcher, experts = (config.routed_experts.token_dispatcher,
                           config.routed_experts.inner_experts)
    assert type(dispatcher) is tt.MxcommTokenDispatcher.Config
    assert (dispatcher.dispatch_precision, dispatcher.combine_precision,
            dispatcher.dispatch_grad_precision, dispatcher.combine_grad_precision,
            dispatcher.permute_align) == ("fp8_rowwise", "bf16", "bf16", "fp8_rowwise", 32)
    assert type(experts) is tt.MxcommGroupedExperts.Config and experts.gemm == "fp8"
    assert (experts.dim, experts.hidden_dim, experts.num_experts) == (DIM, HIDDEN, E_LOCAL)
    auto = _recipe_moe(4, "auto")
    dispatcher, experts = (auto.routed_experts.token_dispatcher,
                           auto.routed_experts.inner_experts)
    assert type(dispatcher) is tt.MxcommTokenDispatcher.Config
    assert (dispatcher.recipe, dispatcher.dim, dispatcher.hidden, dispatcher.permute_align) == \
        ("auto", DIM, HIDDEN, 0)
    assert type(experts) is tt.MxcommGroupedExperts.Config and experts.gemm == "auto"
    from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher
    torchao = _moe_config(TorchAOTokenDispatcher.Config(num_experts=4, top_k=2, pad_multiple=16))
    with pytest.raises(ValueError, match="recipe 'auto': needs torchtitan's AllToAll"):
        tt.use_mxcomm(torchao, recipe="auto")
    with pytest.raises(ValueError, match="recipe: expected None or 'auto'"):
        tt.MxcommTokenDispatcher.Config(num_experts=4, top_k=2, recipe="mxfp8").build()
    with pytest.raises(ValueError, match="dispatch_grad_across_nodes"):
        tt.MxcommTokenDispatcher.Config(num_experts=4, top_k=2,
                                        dispatch_grad_across_nodes="fp4").build()
    with pytest.raises(ValueError, match="gemm"):
        tt.MxcommGroupedExperts.Config(dim=8, hidden_dim=8, num_experts=1, gemm="fp4").build()
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    overrides = importlib.import_module("torchtitan.config.override")
    moe = _moe_config(AllToAllTokenDispatcher.Config(num_experts=4, top_k=2))
    recipes = types.ModuleType("mxcomm.recipes")  # until mxcomm.recipes lands: its get_recipe
    recipes.get_recipe = {"fp8_rowwise": FP8_ROWWISE}.__getitem__
    saved = sys.modules.get("mxcomm.recipes")
    sys.modules.setdefault("mxcomm.recipes", recipes)
    try:
        log = overrides.apply_overrides(overrides.OverrideConfig(imports=[(
            "mxcomm.integrations.torchtitan.mxcomm_moe", {"recipe": "fp8_rowwise"})]), moe)
    finally:
        if saved is None and sys.modules.get("mxcomm.recipes") is recipes:
            del sys.modules["mxcomm.recipes"]
    assert len(log) == 1
    assert type(moe.routed_experts.token_dispatcher) is tt.MxcommTokenDispatcher.Config
    assert type(moe.routed_experts.inner_experts) is tt.MxcommGroupedExperts.Config


def across_nodes_checks(rank, size):
    """The dispatch gradient's format a pinned ``"fp8_rowwise"`` runs with after
    ``wire_meshes`` (the group's nodes: ``$MXCOMM_NODE_SIZE``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mxcomm.recipes import get_recipe
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
    moe = _recipe_moe(E_LOCAL * size, get_recipe("fp8_rowwise")).build()
    dispatcher = moe.routed_experts.token_dispatcher
    before = dispatcher._path.dispatch_grad
    dispatcher.wire_meshes(ep_mesh=mesh)
    return before, dispatcher._path.dispatch_grad


@pytest.mark.parametrize("node_size, want", [(None, "bf16"), (1, "mxfp8")])
def test_pinned_recipe_follows_the_topology(monkeypatch, node_size, want):
    """``use_mxcomm(recipe="fp8_rowwise")``: on one node the dispatch gradient stays bf16; where
    the EP group spans nodes (emulated: a node per rank) ``wire_meshes`` makes it MXFP8, as
    ``ExpertParallel`` runs the recipe (``Recipe.for_nodes``)."""
    from torch_world import run_world
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    if node_size is None:
        monkeypatch.delenv("MXCOMM_NODE_SIZE", raising=False)
    else:
        monkeypatch.setenv("MXCOMM_NODE_SIZE", str(node_size))
    assert run_world(2, across_nodes_checks) == [("bf16", want)] * 2


def default_compiled_checks(rank, size):
    """torchtitan's MoE layer with mxcomm's default dispatcher (MXFP8 dispatch, bf16 combine,
    plain rows) eager and compiled with ``fullgraph=True``: equality, the exchanges mxcomm made
    in each, and the host collectives of a second step of each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    from mxcomm.integrations.torchtitan import MxcommTokenDispatcher
    from mxcomm.torch import _ops
    ran = []
    real = _ops._exchange

    def counted(function, *args):
        ran.append(function)
        return real(function, *args)

    _ops._exchange = counted
    titan_utils.set_spmd_backend("full_dtensor")
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    config = MxcommTokenDispatcher.Config(num_experts=E_LOCAL * size, top_k=TOP_K)
    moe = _moe(E_LOCAL * size, config)
    moe.load_state_dict(_weights(rank, size), strict=False)
    moe.to(dtype=torch.bfloat16)
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    from mxcomm.torch import communicator_for
    comm = communicator_for(mesh.get_group())
    eager = _layer_step(moe, rank)
    eager_ran = sorted(ran)
    before = comm.host_collectives
    _layer_step(moe, rank)  # a second step: what a step costs once the layout's E is known
    votes = [comm.host_collectives - before]
    ran.clear()
    moe.zero_grad(set_to_none=True)
    compiled_moe = torch.compile(moe, fullgraph=True, backend="aot_eager")
    compiled = _layer_step(compiled_moe, rank)
    compiled_ran = sorted(ran)
    before = comm.host_collectives
    _layer_step(compiled_moe, rank)
    votes.append(comm.host_collectives - before)
    return {k: torch.equal(eager[k], compiled[k]) for k in eager}, eager_ran, compiled_ran, votes


def test_torchtitan_default_dispatcher_compiled():
    """Compiled (``fullgraph=True``), mxcomm's default dispatcher makes its token exchanges
    through mxcomm's ops on the layout, as many as eager, with one host collective per step
    (the layout's agreement) in both: no vote per exchange; its output and gradients equal
    eager's bit for bit."""
    expected = sorted(["a2a_dispatch", "a2a_combine", "a2a_combine_backward",
                       "a2a_dispatch_backward"])
    for rank, (equal, eager_ran, compiled_ran, votes) in enumerate(
            run_world(2, default_compiled_checks, timeout=600)):
        assert all(equal.values()), f"rank {rank}: compiled differs from eager: {equal}"
        assert eager_ran == compiled_ran == expected, (rank, eager_ran, compiled_ran)
        assert votes == [1, 1], (rank, votes)


def auto_checks(rank, size, device="cpu"):
    """torchtitan's MoE layer with ``use_mxcomm(recipe="auto")`` and a host-backend cost table
    (``$MXCOMM_COST_TABLE``) whose crossover lies below, then above, the rows each rank routes:
    the recipe each call ran (eager from the layout, compiled as traced), and the results
    against the same layer with that recipe pinned, eager and compiled."""
    import os
    import tempfile

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    import mxcomm.integrations.torchtitan as tt
    from mxcomm import recipes
    from mxcomm.integrations import _titan_hooks
    titan_utils.set_spmd_backend("full_dtensor")
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch 2.11: as recipe_checks
        torch.compiler._is_non_strict_tracing = lambda: False
    mesh = init_device_mesh(device, (size,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    experts = E_LOCAL * size
    name_here = "cpu" if device == "cpu" else torch.cuda.get_device_name()
    chosen = []
    real = _titan_hooks.MxcommExchanges._path_for

    def recording(self, layout, x):
        path = real(self, layout, x)
        chosen.append(path.recipe)
        return path

    _titan_hooks.MxcommExchanges._path_for = recording
    torch._dynamo.config.capture_scalar_outputs = True
    rows = BATCH * SEQ * TOP_K  # every rank routes as many
    folder = tempfile.mkdtemp()
    result = {}
    for cut, name in ((2 * rows, "bf16"), (rows // 2, "mxfp8")):
        table = recipes.CostTable(rows=(1, cut, 2 * cut), ms={"bf16": (1.0, 2.0, 4.0),
                                                              "mxfp8": (1.5, 2.0, 2.5)},
                                  ref_dim=DIM, ref_hidden=HIDDEN, device=name_here,
                                  world_size=size, experts_per_rank=E_LOCAL)
        os.environ[recipes.TABLE_ENV] = str(recipes.save_table(table, f"{folder}/{cut}.json"))
        chosen.clear()
        auto = _built(_recipe_moe(experts, "auto"), rank, size, mesh)
        eager = _layer_step(auto, rank)
        compiled = _layer_step(torch.compile(_built(_recipe_moe(experts, "auto"), rank, size,
                                                    mesh), fullgraph=True, backend="aot_eager"),
                               rank)
        ran = list(chosen)
        pinned = _layer_step(_built(_recipe_moe(experts, name), rank, size, mesh), rank)
        result[name] = (ran, all(torch.equal(eager[k], pinned[k]) for k in eager),
                        all(torch.equal(compiled[k], pinned[k]) for k in eager))
    del os.environ[recipes.TABLE_ENV]
    return result


def test_torchtitan_auto_recipe_follows_the_table_eager_and_compiled():
    """``use_mxcomm(config, recipe="auto")`` on torchtitan's MoE layer: with the crossover of
    the cost table above the rows each rank routes it runs bf16, below it mxfp8 (no fp8 GEMM on
    a CPU), on both ranks, eager and compiled (``fullgraph=True``); its output and gradients
    equal the layer with that recipe pinned, bit for bit."""
    _check_auto(run_world(2, auto_checks, timeout=600))


@pytest.mark.gpu
def test_gpu_torchtitan_auto_recipe_eager_and_compiled():
    """The same on 2 GPUs over NCCL, with a table of these GPUs (bf16 and mxfp8 measured)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_auto(run_world(2, auto_checks, "cuda", timeout=600, gpu=True))


def _check_auto(results):
    for rank, result in enumerate(results):
        for name, (chosen, eager_equal, compiled_equal) in result.items():
            assert chosen == [name, name], (rank, name, chosen)  # eager's call, the trace's
            assert eager_equal and compiled_equal, (rank, name, eager_equal, compiled_equal)
    assert results[0] == results[1]
