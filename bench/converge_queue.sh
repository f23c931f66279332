#!/usr/bin/env bash
# Issue 42's convergence runs on a machine of 4 GPUs: two 2-rank examples/train_moe.py jobs at once,
# one on GPUs 0,1 and one on GPUs 2,3 (each set runs one job at a time: uncontended tokens/s), taking
# runs "VARIANT SEED REPEAT" from QUEUE in order; with RANKS=4, one 4-rank job at a time on all four. No run starts that would not end within BUDGET_S
# seconds of the start (each variant's time is the last one measured, else ESTIMATES below); the
# runs not started are listed at the end of calls.log, to queue in the next call.
#   source .device-kit/env.sh && bash bench/converge_queue.sh QUEUE BUDGET_S
# Needs the corpus wheel in bench/wheels (pip download --no-deps transformers==4.57.1 -d
# bench/wheels; carried). Writes $OUT/conv.tar.gz (a JSON and a log per run, calls.log), refreshed
# after every run; merge the JSONs with examples/train_moe_report.py.
set -uo pipefail
queue=$1; budget=$2; t0=$(date +%s)
OUT=${OUT:-/tmp/out}; dir="$OUT/conv"; work=$(mktemp -d)
mkdir -p "$dir"; cp "$queue" "$work/queue"
# seconds per run on 2xH100 at 2026-11-27 (start-up included); unknown variants: 260
printf '%s\n' "bf16 150" "recipe:auto 140" "recipe:fp8_rowwise 230" "mxfp8 160" "recipe:mxfp8 150" \
    "bf16_fp8gemm 240" > "$work/est"
ranks=${RANKS:-2}; more=()
# at 4 ranks on 4xH200 (2026-11-28): bf16 115-154 s, the fp8 recipe 161-217 s, the mxfp8 recipe
# 105-123 s, bf16_fp8gemm 181 s
[ "$ranks" = 4 ] && printf '%s\n' "bf16 160" "recipe:fp8_rowwise 200" "recipe:mxfp8 130" \
    "bf16_fp8gemm 190" >> "$work/est"
[ "$ranks" = 4 ] && more=(--batch 8)  # the same 16,384 tokens a step as 2 ranks of batch 16
export MXCOMM_COMMIT=${MXCOMM_COMMIT:-$(git rev-parse --short HEAD)}  # set it where the machine's git lags the tree
{ echo "start $(date -u +%FT%TZ) commit $MXCOMM_COMMIT budget ${budget}s"; nvidia-smi -L; } > "$dir/calls.log"
locked() { flock "$work/lock" bash -c "$1"; }

worker() {  # worker GPUS NAME
    local gpus=$1 name=$2 line v s r est now tag a rc d
    while :; do
        line=$(locked "head -n1 '$work/queue'; sed -i 1d '$work/queue'")
        [ -z "$line" ] && return
        read -r v s r <<< "$line"
        est=$(locked "awk -v v='$v' '\$1 == v {e = \$2} END {print e ? e : 260}' '$work/est'")
        now=$(( $(date +%s) - t0 ))
        if [ $(( now + est )) -gt "$budget" ]; then
            echo "$name: not started: $line (at ${now}s, ${est}s expected)" >> "$dir/calls.log"
            locked "echo '$line' >> '$work/left'"; continue
        fi
        tag="w${ranks}_s${s}_r${r}_$(echo "$v" | tr -c 'A-Za-z0-9\n' '-')"
        echo "$name: start $line at ${now}s on GPUs $gpus" >> "$dir/calls.log"
        a=$(date +%s)
        CUDA_VISIBLE_DEVICES=$gpus timeout $(( budget - now + 60 )) mpirun --bind-to none -x PYTHONPATH \
            -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS \
            -x NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS -x PYTHONUNBUFFERED -x CUDA_VISIBLE_DEVICES \
            -x MXCOMM_COMMIT -n "$ranks" python3 examples/train_moe.py --corpus-dir bench/wheels \
            --variants "$v" --seeds "$s" --repeats "$r" "${more[@]}" \
            --max-minutes "$(awk -v x=$(( budget - now - 10 )) 'BEGIN {printf "%.2f", x / 60}')" \
            --json "$dir/converge_$tag.json" > "$dir/log_$tag.txt" 2>&1
        rc=$?; d=$(( $(date +%s) - a ))
        echo "$name: done $line rc $rc in ${d}s" >> "$dir/calls.log"
        [ $rc -eq 0 ] && locked "echo '$v $(( d + 10 ))' >> '$work/est'"
        locked "tar -czf '$OUT/conv.tar.gz' -C '$OUT' conv"
    done
}

if [ "$ranks" = 4 ]; then worker 0,1,2,3 A; else worker 0,1 A & worker 2,3 B & wait; fi
{ echo "not started (queue them next):"; cat "$work/left" "$work/queue" 2>/dev/null
  echo "end $(date -u +%FT%TZ)"; } >> "$dir/calls.log"
tar -czf "$OUT/conv.tar.gz" -C "$OUT" conv
rm -rf "$dir"/*.json "$dir"/log_*   # in the tarball: only so many files come back from $OUT
