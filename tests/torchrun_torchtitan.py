"""torchtitan's MoE layer with mxcomm's dispatcher under ``torchrun``, one GPU per rank: the checks
of ``tests/test_torchtitan.py`` (native and bf16 bit-identical to torchtitan's own dispatcher under
both spmd backends, MXFP8 SQNR >= 25 dB), in a world that torchrun launched (NCCL process group
from torchrun's environment; mxcomm's communicator built over the EP mesh, no MPI).

Run on a machine with 2 GPUs: ``torchrun --nproc-per-node 2 tests/torchrun_torchtitan.py``
(``bench/gpu_run.sh titan2``). Every rank prints its SQNRs; the exit status is non-zero if a check
failed on any rank.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_torchtitan import SQNR_DB, moe_checks  # noqa: E402


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    failure = ""
    try:
        sqnrs = moe_checks(rank, size, "cuda")
        low = {f"{variant} under {backend}: {k}": round(v, 2)
               for (backend, variant), values in sqnrs.items()
               for k, v in values.items() if not v >= SQNR_DB}
        for (backend, variant), values in sorted(sqnrs.items()):
            shown = ", ".join(f"{k} {v:.2f}" for k, v in values.items())
            print(f"rank {rank}: {backend} {'/'.join(variant)}: SQNR dB: {shown}", flush=True)
        if low:
            failure = f"SQNR below {SQNR_DB} dB: {low}"
    except Exception as exc:  # noqa: BLE001 (reported, and every rank learns of it below)
        failure = f"{type(exc).__name__}: {exc}"
    failures = [None] * size
    dist.all_gather_object(failures, failure)
    dist.destroy_process_group()
    bad = {r: f for r, f in enumerate(failures) if f}
    if bad:
        print(f"rank {rank}: FAILED on ranks {sorted(bad)}: {bad}", flush=True)
        sys.exit(1)
    print(f"rank {rank}: torchtitan MoE under torchrun on {size} GPUs: native and bf16 "
          f"bit-identical to torchtitan's dispatcher, MXFP8 SQNR >= {SQNR_DB} dB", flush=True)


if __name__ == "__main__":
    main()
