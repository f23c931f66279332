#!/usr/bin/env bash
# One call on a lent GPU machine: gpu tests and benchmarks, logs and results under $OUT.
#   source .device-kit/env.sh && bash bench/gpu_run.sh PHASE...
# phases: every4 tests1 faults2 ktests1 tests2 formats2 tests4 flaky4 graph4 formats4 nodes4 (SOCKET_NTHREADS, NSOCKS_PERTHREAD, NODES_A2A, NODES_VARIANTS) nodestransport4 (NODES_TOKENS, NODES_VARIANTS, NODES_STAGES, NODES_ROUNDS) tracenodes4 (NODES_TOKENS, PEER_MEMORY) wire4 (NODES_TOKENS, NODES_NCCL_DEBUG, NODES_NCCL_SUBSYS) wireone4 (WIRE_ROWS) pipe4fp8 pipe4fp8i pipe4small fused4 pmsmall2 pmsmall4 sxsmall2 sxsmall4 (SMALL_ROUTING) sxsweep2 sxsweep4 (SX_VALUES, SWEEP_TOKENS) mxsweep2 mxsweep4 (MX_VALUES) stepfp8_4 profile4fresh step4 pipe4fp8stages dequant4 kernels a2a2 a2a4 pipe2 pipe4 pipe2small pipe2topk latency2 latency4
#         converge2check converge2 converge4 (CONVERGE_VARIANTS, CONVERGE_SEEDS, CONVERGE_REPEATS) soak2 profile2 profile2fresh step2 steppieces2 torch1 torchrun2 titan2 titanbench2 titanbench4 (TITAN_SITE, TITAN_TOKENS, TITAN_ITERS) graph2 pipe2fp8 pipe1fp8 row1
#         pipeab1fp8 pipe2fp8i pipe2fp8stages gcab2 gcsmall2 fused2 dequant2 stepfp8_2 stepfp8small2 colwise1 ncu1 gather1 ncugather1 gemm1 host1 host2 host4 self2 self4 hostab1 pipeab1 colwiseab1 pull2on1 host2on1 latency1 latencyab2 smallab2 layoutab2 stepab2 (AB_OLD, AB_FLOAT: source trees to
#         compare with) overlap2 overlap4 (OVERLAP_TOKENS, OVERLAP_VARIANTS) overlapprobe2 (PROBE_ROWS, PROBE_DISPATCH_GRAD, PROBE_PEER_MEMORY) chunks2 chunks4 (CHUNK_ROWS, CHUNKS, PROBE_PEER_MEMORY) chunksnodes4 (CHUNK_ROWS, CHUNKS, CHUNK_ITERS, SOCKET_NTHREADS, NSOCKS_PERTHREAD) chunksbisect4 titanab2 (TITAN_SITE, TITAN_TOKENS, TITAN_ITERS)
# Results (JSON, Markdown, PNG) go to $OUT/results.tar.gz, refreshed after every step so a run cut
# short still returns what it finished; logs to $OUT/gpu.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
res=/tmp/mxcomm-results
mkdir -p "$OUT" "$res"
log="$OUT/gpu.log"
# the commit that results name: set MXCOMM_COMMIT where the machine's git may lag the tree it runs
# (a copied working tree over an older checkout); else HEAD, marked "+modified" if the tree differs
if [ -z "${MXCOMM_COMMIT:-}" ]; then
    MXCOMM_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    git diff --quiet HEAD -- . 2>/dev/null || MXCOMM_COMMIT="$MXCOMM_COMMIT+modified"
fi
export MXCOMM_COMMIT
ngpu=$(nvidia-smi -L | wc -l)
FP8_VARIANTS=${FP8_VARIANTS:-auto,mxfp8,fp8_rowwise,mxfp8_all,bf16+fp8gemm,fp8_rowwise_bf16grad,mxfp8+rowwise,fp8_rowwise_mxgrad,fp8_rowwise_bf16wgrad,fp8_rowwise_acc32}
# mpirun_env of the kit, as a command (timeout cannot run a shell function)
mpirun_env=(mpirun --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
    -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS -x PYTHONUNBUFFERED -x MXCOMM_COMMIT)
# 4 ranks as 2 emulated nodes x 2 (nodes4, chunksnodes4): MXCOMM_NODE_SIZE=2 for mxcomm,
# NCCL_HOSTID=node<k> per pair (run the command under bash -c "$per_node"), NCCL's socket
# transport between the pairs with its threads raised (SOCKET_NTHREADS x NSOCKS_PERTHREAD)
emulated=(env MXCOMM_NODE_SIZE=2 NCCL_NET=Socket NCCL_IB_DISABLE=1 NCCL_DEBUG=${NODES_NCCL_DEBUG:-WARN}
    NCCL_DEBUG_SUBSYS=${NODES_NCCL_SUBSYS:-INIT} "${mpirun_env[@]}" -x MXCOMM_NODE_SIZE -x NCCL_NET
    -x NCCL_IB_DISABLE -x NCCL_DEBUG -x NCCL_DEBUG_SUBSYS)
per_node='NCCL_HOSTID=node$((OMPI_COMM_WORLD_RANK / 2)) exec "$@"'
raised=(env NCCL_SOCKET_NTHREADS=${SOCKET_NTHREADS:-8} NCCL_NSOCKS_PERTHREAD=${NSOCKS_PERTHREAD:-4})

importable() {  # importable TREE: a source tree (git archive) importable by PYTHONPATH=TREE, its
    # kernels/ and comm/ linked where setup.cfg's package_dir installs them
    ln -sfn ../kernels "$1/mxcomm/kernels"; ln -sfn ../comm "$1/mxcomm/comm"
}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date -u +%H:%M:%S))" | tee -a "$log"
    timeout "$secs" "$@" 2>&1 | tee -a "$log" | tail -n 60
    echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$log"
    tar -czf "$OUT/results.tar.gz" -C "$res" . 2>/dev/null
}

{ nvidia-smi -L; uname -r; python3 -c "import importlib.util as u, cupy; \
print('cuda.bindings', u.find_spec('cuda.bindings') is not None, 'cupy memcpyBatchAsync', \
hasattr(cupy.cuda.runtime, 'memcpyBatchAsync'))"; python3 -c "import torch, cupy, numba_cuda, numpy; from cupy.cuda import nccl; \
print('torch', torch.__version__, 'cupy', cupy.__version__, 'numba-cuda', numba_cuda.__version__, \
'numpy', numpy.__version__, 'nccl', nccl.get_version())"; } 2>&1 | tee -a "$log"

for phase in "$@"; do
    case $phase in
    every4)  # every GPU test set on a 4-GPU machine (~380 s on 4xH200): the 1-process set on GPUs
        # 2,3 beside the 2-rank sets on GPUs 0,1 (logs in $OUT/gpus23, $OUT/gpus01), then the 4-rank
        # sets and the emulated nodes' tests here
        if [ "$ngpu" -lt 4 ]; then echo "=== $phase: needs 4 GPUs, $ngpu here" | tee -a "$log"; continue; fi
        CUDA_VISIBLE_DEVICES=2,3 OUT="$OUT/gpus23" bash "$0" tests1 > /dev/null 2>&1 &
        CUDA_VISIBLE_DEVICES=0,1 OUT="$OUT/gpus01" bash "$0" tests2 graph2 faults2 > /dev/null 2>&1 &
        wait
        grep -h "^=== .* exit" "$OUT/gpus23/gpu.log" "$OUT/gpus01/gpu.log" | tee -a "$log"
        NODES_A2A=0 NODES_PIPELINE=0 bash "$0" tests4 graph4 nodes4 ;;
    tests1) step "gpu tests, 1 process" 400 python3 -m pytest -q -m "gpu and not mpi and not faults" tests ;;
    faults2) step "gpu fault cases, 2 ranks each (issue 44)" 300 env FAULTS_RANKS=2 \
        FAULTS_MPIEXEC="mpirun --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED" \
        python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu and faults" tests/test_faults.py ;;
    ktests1)  # the kernel tests CI runs in Numba's simulator (every e4m3 byte under every shift,
        # NaN/Inf and subnormal rows, ...), here on the GPU's kernels (their fixture picks them)
        step "kernel tests on the GPU's kernels, 1 process" 300 python3 -m pytest -q -p no:cacheprovider \
            -m "not mpi and not faults" tests/test_fp8_formats.py tests/test_mxfp8.py \
            tests/test_permute.py tests/test_formats.py ;;
    tests2) step "gpu tests, 2 ranks" 200 "${mpirun_env[@]}" --output-filename "$OUT/ranks-tests2" \
        -n 2 python3 -m pytest -q -rfE -p no:cacheprovider \
        -o faulthandler_timeout=90 -W ignore::DeprecationWarning --with-mpi -m "gpu and mpi" \
        --deselect tests/test_layout.py::test_gpu_cuda_graph_replays_the_token_path tests ;;
    pull2on1)  # two ranks on ONE GPU: NCCL never built (nccl_init lazy, which NCCL's duplicate-GPU
        # check would refuse), exchanges pulled over CUDA IPC between the two processes: the
        # pull transport's 2-rank gpu tests and its CUDA-graph test without the bf16 combine
        step "pull transport, 2 ranks on 1 GPU, gpu tests" 240 env MXCOMM_NCCL_INIT=lazy \
            MXCOMM_GRAPH_TEST=pull "${mpirun_env[@]}" -x MXCOMM_NCCL_INIT -x MXCOMM_GRAPH_TEST \
            -n 2 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 \
            -W ignore::DeprecationWarning --with-mpi -m "gpu and mpi" \
            -k "layout_path_equals_validated or permute_align or rank_skipping or cuda_graph or (nccl_exchange and pull)" \
            tests/test_layout.py tests/test_comm.py ;;
    host2on1)  # the host probe of the MXFP8 calls with two ranks on ONE GPU (as pull2on1; host
        # times are real, device times are not: the two processes time-slice the GPU)
        # AB_OLD set (a tree that has nccl_init): this probe on it and on this tree, alternating, twice
        for round in 1 2; do
            if [ -n "${AB_OLD:-}" ]; then
                importable "$AB_OLD"
                step "host path pieces, 2 ranks on 1 GPU (MXFP8 calls), OLD tree $AB_OLD (round $round)" 150 \
                    env MXCOMM_NCCL_INIT=lazy PROBE_CASES=mxfp8 PYTHONPATH="$AB_OLD:${PYTHONPATH:-}" \
                    "${mpirun_env[@]}" -x MXCOMM_NCCL_INIT -x PROBE_CASES -n 2 \
                    python3 bench/probe_host.py 4096 7168 ${AB_CALLS:-300}
            fi
            step "host path pieces, 2 ranks on 1 GPU (MXFP8 calls), this tree (round $round)" 150 \
                env MXCOMM_NCCL_INIT=lazy PROBE_CASES=mxfp8 PROBE_ABLATIONS=0 "${mpirun_env[@]}" \
                -x MXCOMM_NCCL_INIT -x PROBE_CASES -x PROBE_ABLATIONS -n 2 \
                python3 bench/probe_host.py 4096 7168 ${AB_CALLS:-300}
            [ -n "${AB_OLD:-}" ] || break
        done ;;
    graph2) step "CUDA graph test, 2 ranks" 90 "${mpirun_env[@]}" --output-filename "$OUT/ranks-graph2" \
        -n 2 python3 -m pytest -q -rfE -p no:cacheprovider -o faulthandler_timeout=70 -W ignore::DeprecationWarning --with-mpi \
        tests/test_layout.py::test_gpu_cuda_graph_replays_the_token_path ;;
    tests4) [ "$ngpu" -ge 4 ] && step "gpu tests, 4 ranks" 300 "${mpirun_env[@]}" --output-filename "$OUT/ranks-tests4" \
        -n 4 python3 -m pytest -q -rfE -p no:cacheprovider \
        -o faulthandler_timeout=120 -W ignore::DeprecationWarning --with-mpi -m "gpu and mpi" \
        --deselect tests/test_layout.py::test_gpu_cuda_graph_replays_the_token_path tests ;;
    flaky4)  # the 4-rank backward test that failed only inside the whole suite, where
        # tests/test_nodes.py had left NCCL_HOSTID=node<rank> set (bench/NOTES.md, 2026-11-27):
        # its body under each configuration (bench/probe_flaky.py), the file alone with that
        # environment set per rank (the suite's configuration, no other test before it), then
        # tests/test_nodes.py before it (the suite's order: it passes if the environment is restored)
        per_rank='NCCL_HOSTID=node$OMPI_COMM_WORLD_RANK exec "$@"'
        [ "$ngpu" -ge 4 ] && step "flaky4: probe_flaky, 4 ranks, 3 repeats" 240 "${mpirun_env[@]}" \
            --output-filename "$OUT/ranks-flaky4-probe" -n 4 python3 bench/probe_flaky.py 3 mxfp8
        [ "$ngpu" -ge 4 ] && for i in 1 2; do
            step "flaky4: test_recipes alone with NCCL_HOSTID=node<rank>, 4 ranks, round $i" 150 \
                "${mpirun_env[@]}" --output-filename "$OUT/ranks-flaky4-hostid$i" -n 4 bash -c "$per_rank" _ \
                python3 -m pytest -q -rfE -p no:cacheprovider -W ignore::DeprecationWarning --with-mpi \
                -m "gpu and mpi" tests/test_recipes.py
        done
        [ "$ngpu" -ge 4 ] && step "flaky4: test_nodes then test_recipes, 4 ranks" 300 "${mpirun_env[@]}" \
            --output-filename "$OUT/ranks-flaky4-order" -n 4 python3 -m pytest -q -rfE -p no:cacheprovider \
            -W ignore::DeprecationWarning --with-mpi -m "gpu and mpi" tests/test_nodes.py tests/test_recipes.py ;;
    graph4) [ "$ngpu" -ge 4 ] && step "CUDA graph test, 4 ranks" 120 "${mpirun_env[@]}" --output-filename "$OUT/ranks-graph4" \
        -n 4 python3 -m pytest -q -rfE -p no:cacheprovider -o faulthandler_timeout=100 -W ignore::DeprecationWarning --with-mpi \
        tests/test_layout.py::test_gpu_cuda_graph_replays_the_token_path ;;
    formats4) [ "$ngpu" -ge 4 ] && step "format exchanges on GPUs, 4 ranks" 240 "${mpirun_env[@]}" --output-filename "$OUT/ranks-formats4" \
        -n 4 python3 -m pytest -q -rfE -p no:cacheprovider \
        -o faulthandler_timeout=120 -W ignore::DeprecationWarning --with-mpi -m mpi tests/test_formats_ep.py ;;
    pipe4fp8) [ "$ngpu" -ge 4 ] && step "bench pipeline, 4 ranks, fp8 GEMM variants, 131072 rows" 500 "${mpirun_env[@]}" -n 4 \
        python3 -m mxcomm.bench pipeline --tokens 131072 --dim 7168 8192 --hidden 2048 5120 --experts 8 \
        --no-stages --variants $FP8_VARIANTS \
        --json "$res/pipeline_fp8_w4.json" --markdown "$res/pipeline_fp8_w4.md" --plot "$res/pipeline_fp8_w4.png" ;;
    pipe4fp8i) [ "$ngpu" -ge 4 ] && step "bench pipeline, 4 ranks, fp8 GEMM variants, 131072 rows, interleaved" 500 \
        "${mpirun_env[@]}" -n 4 python3 -m mxcomm.bench pipeline --tokens 131072 --dim 7168 8192 --hidden 2048 5120 \
        --experts 8 --no-stages --interleave --iters ${PIPE_ITERS:-30} --variants $FP8_VARIANTS \
        --json "$res/pipeline_fp8_interleaved_w4.json" --markdown "$res/pipeline_fp8_interleaved_w4.md" ;;
    pipe4small) [ "$ngpu" -ge 4 ] && step "bench pipeline, 4 ranks, small batches, ${SMALL_ROUTING:-uniform} routing" 300 \
        "${mpirun_env[@]}" -n 4 python3 -m mxcomm.bench pipeline --routing ${SMALL_ROUTING:-uniform} \
        --tokens ${SMALL_TOKENS:-4096 16384 32768 65536} --dim 7168 --hidden 2048 --experts 8 --no-stages --interleave \
        --variants ${SMALL_VARIANTS:-mxfp8,fp8_rowwise} \
        --json "$res/pipeline_small_${SMALL_ROUTING:-uniform}_w4.json" \
        --markdown "$res/pipeline_small_${SMALL_ROUTING:-uniform}_w4.md" ;;
    formats2) step "format exchanges on GPUs, 2 ranks" 200 "${mpirun_env[@]}" --output-filename "$OUT/ranks-formats2" \
        -n 2 python3 -m pytest -q -rfE -p no:cacheprovider \
        -o faulthandler_timeout=90 -W ignore::DeprecationWarning --with-mpi -m mpi tests/test_formats_ep.py ;;
    kernels) step "bench kernels" 300 python3 -m mxcomm.bench kernels --formats ${KERNEL_FORMATS:-mxfp8 fp8_rowwise fp8_block128 fp8_block128_pow2} \
        --json "$res/kernels${KERNEL_SUFFIX:-}.json" --markdown "$res/kernels${KERNEL_SUFFIX:-}.md" ;;
    a2a2) step "bench a2a, 2 ranks" 400 "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench a2a \
        --json "$res/a2a_w2.json" --markdown "$res/a2a_w2.md" ;;
    a2a4) [ "$ngpu" -ge 4 ] && step "bench a2a, 4 ranks" 400 "${mpirun_env[@]}" -n 4 python3 -m mxcomm.bench a2a \
        --json "$res/a2a_w4.json" --markdown "$res/a2a_w4.md" ;;
    pipe2) step "bench pipeline, 2 ranks" 400 "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench pipeline \
        --json "$res/pipeline_w2.json" --markdown "$res/pipeline_w2.md" --plot "$res/pipeline_w2.png" ;;
    overlap2|overlap4)  # issue 43's A/B: the fp8 recipe with and without the backward overlap, and
        # with its former MXFP8 dispatch gradient, interleaved, side by side (and bf16, the
        # reference); then the overlap's gpu tests
        n=${phase#overlap}
        [ "$ngpu" -ge "$n" ] && step "bench pipeline, $n ranks, fp8_rowwise with and without overlap" 500 \
            "${mpirun_env[@]}" -n "$n" python3 -m mxcomm.bench pipeline \
            --tokens ${OVERLAP_TOKENS:-4096 16384 32768 65536 131072} --dim 7168 --hidden 2048 --experts 8 \
            --no-stages --interleave --iters ${PIPE_ITERS:-20} --variants ${OVERLAP_VARIANTS:-fp8_rowwise,fp8_rowwise_serial,fp8_rowwise_mxdgrad} \
            --json "$res/pipeline_overlap_w$n.json" --markdown "$res/pipeline_overlap_w$n.md" \
        && [ "$n" = 2 ] && step "overlap gpu tests, 2 ranks" 200 "${mpirun_env[@]}" -n 2 python3 -m pytest -q \
            -rfE -p no:cacheprovider -o faulthandler_timeout=90 -W ignore::DeprecationWarning --with-mpi \
            -m "gpu and mpi" tests/test_overlap.py ;;
    overlapprobe2)  # the backward's timeline on its two streams, fp8_rowwise with and without
        # overlap (bench/probe_overlap.py): where the time goes if the A/B misses its target
        step "probe: the backward's timeline with and without overlap, 2 ranks" 300 \
            env PROBE_MARKDOWN="$res/probe_overlap${PROBE_DISPATCH_GRAD:+_$PROBE_DISPATCH_GRAD}_pm${PROBE_PEER_MEMORY:-auto}_w2.md" \
            PROBE_DISPATCH_GRAD="${PROBE_DISPATCH_GRAD:-}" PROBE_PEER_MEMORY=${PROBE_PEER_MEMORY:-auto} \
            "${mpirun_env[@]}" -x PROBE_MARKDOWN -x PROBE_DISPATCH_GRAD -x PROBE_PEER_MEMORY -n 2 \
            python3 bench/probe_overlap.py ${PROBE_ROWS:-131072} 7168 2048 8 20 ;;
    chunks2|chunks4)  # issue 43: the forward's chunked overlap with the public primitives (token
        # blocks; bench/probe_chunks.py): one chunk, C chunks on one stream, C chunks on two streams
        n=${phase#chunks}
        [ "$ngpu" -ge "$n" ] && for rows in ${CHUNK_ROWS:-32768 131072}; do
            step "probe: chunked overlap, $n ranks, $rows rows, ${CHUNKS:-2} chunks" 200 \
                env PROBE_MARKDOWN="$res/probe_chunks_${rows}_c${CHUNKS:-2}_pm${PROBE_PEER_MEMORY:-auto}_w$n.md" \
                PROBE_PEER_MEMORY=${PROBE_PEER_MEMORY:-auto} "${mpirun_env[@]}" -x PROBE_MARKDOWN -x PROBE_PEER_MEMORY \
                -n "$n" python3 bench/probe_chunks.py "$rows" 7168 2048 8 20 ${CHUNKS:-2}
        done ;;
    chunksnodes4)  # the same probe at 2 emulated nodes x 2 (socket threads raised), where the
        # exchanges are as long as the GEMMs: what chunking the forward buys across nodes
        [ "$ngpu" -ge 4 ] && for rows in ${CHUNK_ROWS:-16384 131072}; do
            step "probe: chunked overlap, 2 emulated nodes x 2, $rows rows, ${CHUNKS:-2} chunks" 400 \
                "${raised[@]}" PROBE_MARKDOWN="$res/probe_chunks_nodes2x2_${rows}_c${CHUNKS:-2}_w4.md" \
                "${emulated[@]}" -x NCCL_SOCKET_NTHREADS -x NCCL_NSOCKS_PERTHREAD -x PROBE_MARKDOWN -n 4 \
                bash -c "$per_node" _ python3 bench/probe_chunks.py "$rows" 7168 2048 8 ${CHUNK_ITERS:-8} ${CHUNKS:-2}
        done ;;
    chunksbisect4)  # the chunk probe's 4-rank input-gradient difference (bench/NOTES.md, 2026-11-28):
        # one step's format changed at a time (the default, then the GEMM in bf16, the combine
        # gradient in bf16, the dispatch gradient in MXFP8): which step it comes from
        [ "$ngpu" -ge 4 ] && for v in "" PROBE_GEMM=bf16 PROBE_COMBINE_GRAD=bf16 PROBE_DISPATCH_GRAD=mxfp8; do
            step "probe: chunked overlap, 4 ranks, 131072 rows, ${v:-default}" 120 \
                env PROBE_MARKDOWN="$res/probe_chunks_bisect_${v:-default}_w4.md" $v "${mpirun_env[@]}" \
                -x PROBE_MARKDOWN -x PROBE_GEMM -x PROBE_COMBINE_GRAD -x PROBE_DISPATCH_GRAD \
                -n 4 python3 bench/probe_chunks.py 131072 7168 2048 8 5 2
        done ;;
    pipe4) [ "$ngpu" -ge 4 ] && step "bench pipeline, 4 ranks" 400 "${mpirun_env[@]}" -n 4 python3 -m mxcomm.bench pipeline \
        --json "$res/pipeline_w4.json" --markdown "$res/pipeline_w4.md" --plot "$res/pipeline_w4.png" ;;
    pipe2small) step "bench pipeline, 2 ranks, small batches" 500 "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench pipeline \
        --tokens ${SMALL_TOKENS:-4096 16384 32768 65536} --dim 7168 --hidden 2048 --experts 8 --no-stages --interleave \
        --variants ${SMALL_VARIANTS:-mxfp8,fp8_rowwise} \
        --json "$res/pipeline_small_w2.json" --markdown "$res/pipeline_small_w2.md" ;;
    pmsmall2|pmsmall4)  # the small-batch pipeline with peer memory (pull) and without (grouped: one
        # NCCL group per exchange), one after the other: which transport serves small batches
        n=${phase#pmsmall}
        [ "$ngpu" -ge "$n" ] && for pm in auto off; do
            step "bench pipeline, $n ranks, small batches, --peer-memory $pm" 300 "${mpirun_env[@]}" -n "$n" \
                python3 -m mxcomm.bench pipeline --peer-memory $pm --tokens ${SMALL_TOKENS:-4096 16384 32768 65536} \
                --dim 7168 --hidden 2048 --experts 8 --no-stages --interleave --variants ${SMALL_VARIANTS:-mxfp8,fp8_rowwise} \
                --json "$res/pipeline_small_pm${pm}_w$n.json" --markdown "$res/pipeline_small_pm${pm}_w$n.md"
        done ;;
    sxsmall2|sxsmall4)  # the small-batch pipeline with small exchanges moved unquantized (the
        # communicator's default small_exchange_bytes) and staged however small (0), one after
        # the other
        n=${phase#sxsmall}
        [ "$ngpu" -ge "$n" ] && for sx in default 0; do
            sxargs=(); [ "$sx" = 0 ] && sxargs=(--small-exchange-bytes 0)
            step "bench pipeline, $n ranks, small batches, small exchanges: $sx" 300 "${mpirun_env[@]}" -n "$n" \
                python3 -m mxcomm.bench pipeline "${sxargs[@]}" --routing ${SMALL_ROUTING:-uniform} \
                --tokens ${SMALL_TOKENS:-4096 16384 32768 65536} \
                --dim 7168 --hidden 2048 --experts 8 --no-stages --interleave --variants ${SMALL_VARIANTS:-mxfp8,fp8_rowwise} \
                --json "$res/pipeline_small_sx${sx}_${SMALL_ROUTING:-uniform}_w$n.json" \
                --markdown "$res/pipeline_small_sx${sx}_${SMALL_ROUTING:-uniform}_w$n.md"
        done ;;
    sxsweep2|sxsweep4|mxsweep2|mxsweep4)  # the small- (SX_VALUES) or medium-exchange limit
        # (MX_VALUES) swept, bytes per rank to its peers, over SWEEP_TOKENS rows per rank,
        # uniform routing, one run per limit
        n=${phase: -1}; kind=${phase%sweep*}
        if [ "$kind" = sx ]; then option=small; values=${SX_VALUES:-0 50331648 134217728 402653184}
        else option=medium; values=${MX_VALUES:-0 134217728 536870912}; fi
        [ "$ngpu" -ge "$n" ] && for limit in $values; do
            step "bench pipeline, $n ranks, ${option}_exchange_bytes $limit" 300 "${mpirun_env[@]}" -n "$n" \
                python3 -m mxcomm.bench pipeline --$option-exchange-bytes "$limit" \
                --tokens ${SWEEP_TOKENS:-16384 32768} --dim 7168 --hidden 2048 --experts 8 --no-stages \
                --interleave --variants ${SWEEP_VARIANTS:-mxfp8} \
                --json "$res/pipeline_${kind}sweep_${limit}_w$n.json" --markdown "$res/pipeline_${kind}sweep_${limit}_w$n.md"
        done ;;
    pipe2fp8) step "bench pipeline, 2 ranks, fp8 GEMM variants, 131072 rows" 400 "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench pipeline \
        --tokens 131072 --dim 7168 8192 --hidden 2048 5120 --experts 8 --no-stages --variants $FP8_VARIANTS \
        --json "$res/pipeline_fp8_w2.json" --markdown "$res/pipeline_fp8_w2.md" --plot "$res/pipeline_fp8_w2.png" ;;
    pipe2fp8i) step "bench pipeline, 2 ranks, fp8 GEMM variants, 131072 rows, interleaved" 500 "${mpirun_env[@]}" -n 2 \
        python3 -m mxcomm.bench pipeline --tokens 131072 --dim 7168 8192 --hidden 2048 5120 --experts 8 \
        --no-stages --interleave --iters ${PIPE_ITERS:-30} --variants $FP8_VARIANTS \
        --json "$res/pipeline_fp8_interleaved_w2.json" --markdown "$res/pipeline_fp8_interleaved_w2.md" \
        --plot "$res/pipeline_fp8_interleaved_w2.png" ;;
    pipe2fp8stages) step "bench pipeline, 2 ranks, fp8 GEMM variants with stages, 131072 rows" 400 \
        "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench pipeline --tokens 131072 --dim 7168 8192 \
        --hidden 2048 5120 --experts 8 --variants ${STAGE_VARIANTS:-bf16+fp8gemm,fp8_rowwise_mxgrad,fp8_rowwise} \
        --json "$res/pipeline_fp8_stages_w2.json" --markdown "$res/pipeline_fp8_stages_w2.md" ;;
    pipe4fp8stages) [ "$ngpu" -ge 4 ] && step "bench pipeline, 4 ranks, fp8 GEMM variants with stages, 131072 rows" 400 \
        "${mpirun_env[@]}" -n 4 python3 -m mxcomm.bench pipeline --tokens 131072 --dim ${STAGE_DIMS:-7168} \
        --hidden ${STAGE_HIDDENS:-2048} --experts 8 --variants ${STAGE_VARIANTS:-bf16+fp8gemm,fp8_rowwise_mxgrad,fp8_rowwise} \
        --json "$res/pipeline_fp8_stages_w4.json" --markdown "$res/pipeline_fp8_stages_w4.md" ;;
    gcab2)  # the fp8 pipeline at 2 ranks, 131072 x 7168 -> 2048, with Python's garbage collector
        # on and off (--gc), alternating, twice: is the forward's slow mode the host's? (At 492cb02,
        # which measured pipeline_gc_w2_h100, "off" was gc.disable() before any import.)
        for round in 1 2; do
            for gc in on off; do
                step "bench pipeline, 2 ranks, fp8_rowwise_mxgrad, gc $gc (round $round)" 200 \
                    "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench pipeline --gc $gc \
                    --tokens 131072 --dim 7168 --hidden 2048 --experts 8 --no-stages \
                    --variants fp8_rowwise_mxgrad,fp8_rowwise --iters 40 \
                    --json "$res/pipeline_gc${gc}_r${round}_w2.json" --markdown "$res/pipeline_gc${gc}_r${round}_w2.md"
            done
        done ;;
    gcsmall2)  # the small-batch pipeline (issue 11) with Python's garbage collector on, then off
        for gc in on off; do
            step "bench pipeline, 2 ranks, small batches, gc $gc" 120 "${mpirun_env[@]}" -n 2 \
                python3 -m mxcomm.bench pipeline --gc $gc --tokens 4096 16384 --dim 7168 --hidden 2048 \
                --experts 8 --no-stages --interleave --variants ${SMALL_VARIANTS:-mxfp8,fp8_rowwise} \
                --json "$res/pipeline_small_gc${gc}_w2.json" --markdown "$res/pipeline_small_gc${gc}_w2.md"
        done ;;
    pipe1fp8) step "bench pipeline, 1 rank, fp8 GEMM variants, 131072 rows" 330 "${mpirun_env[@]}" -n 1 python3 -m mxcomm.bench pipeline \
        --tokens 131072 --dim 7168 8192 --hidden 2048 5120 --experts 8 --no-stages --variants $FP8_VARIANTS \
        --json "$res/pipeline_fp8_w1.json" --markdown "$res/pipeline_fp8_w1.md" ;;
    pipeab1fp8)  # the fp8 GEMM pipeline at 1 rank, 131072 rows: $AB_OLD's tree (variants
        # $AB_OLD_VARIANTS), then this one ($FP8_VARIANTS), in one job
        for tree in "$AB_OLD" "$PWD"; do
            importable "$tree"
            tag=$([ "$tree" = "$PWD" ] && echo new || echo old)
            variants=$([ "$tag" = old ] && echo "${AB_OLD_VARIANTS:-$FP8_VARIANTS}" || echo "$FP8_VARIANTS")
            commit=$([ "$tag" = old ] && echo "${AB_OLD_COMMIT:-old}" || echo "$MXCOMM_COMMIT")
            step "bench pipeline, 1 rank, fp8 GEMM variants, 131072 rows, tree $tree" 330 env -C "$tree" \
                PYTHONPATH="$tree:${PYTHONPATH:-}" MXCOMM_COMMIT="$commit" "${mpirun_env[@]}" -n 1 \
                python3 -m mxcomm.bench pipeline --tokens 131072 --dim 7168 8192 --hidden 2048 5120 \
                --experts 8 --no-stages --variants "$variants" \
                --json "$res/pipeline_fp8_w1_$tag.json" --markdown "$res/pipeline_fp8_w1_$tag.md"
        done ;;
    row1)  # the rowwise quantize and MXFP8 -> rowwise gather of $AB_OLD's tree (if set), then this
        # one's: sweeps (grid share, D), then Nsight Compute on one launch of each, 131072 x 7168
        # (ROW_NCU_OLD=0: on this tree only)
        for tree in ${AB_OLD:-} "$PWD"; do
            importable "$tree"
            step "rowwise sweeps, tree $tree" 150 env PYTHONPATH="$tree:${PYTHONPATH:-}" \
                python3 bench/sweep_rowwise.py --dims 2048 7168
            [ "$tree" != "$PWD" ] && [ "${ROW_NCU_OLD:-1}" = 0 ] && continue  # ncu on this tree only
            for k in quantize_fp8_rowwise_kernel mx_to_rowwise_gather; do
                step "Nsight Compute, $k, tree $tree" 120 env PYTHONPATH="$tree:${PYTHONPATH:-}" \
                    ncu --clock-control none -k regex:$k --launch-skip 5 --launch-count 1 \
                    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                    --section LaunchStats --section WarpStateStats --section SchedulerStats \
                    --section ComputeWorkloadAnalysis python3 bench/sweep_rowwise.py --shares 1 --dims
            done
        done ;;
    colwise1) step "fp8 wgrad conversion kernels, each alone" 120 python3 bench/probe_colwise.py ;;
    dequant2) step "the dequantized exchange's pieces (dispatch gradient), 2 ranks" 240 \
        "${mpirun_env[@]}" -n 2 python3 bench/probe_dequant.py ;;
    dequant4) [ "$ngpu" -ge 4 ] && step "the dequantized exchange's pieces (dispatch gradient), 4 ranks" 240 \
        "${mpirun_env[@]}" -n 4 python3 bench/probe_dequant.py ${DEQUANT_ARGS:-} ;;
    stepfp8_2)  # per-iteration stage times of the fp8 pipeline at 131072 rows: the forward's slow mode
        step "stage times per iteration, fp8 pipeline, 2 ranks" 300 "${mpirun_env[@]}" -n 2 \
            python3 bench/profile_step.py 131072 ${STEP_VARIANTS:-bf16+fp8gemm,fp8_rowwise_mxgrad,fp8_rowwise} \
            none --dim ${STEP_DIM:-8192} --hidden ${STEP_HIDDEN:-5120} --iters 30 ;;
    stepfp8_4)  # per-iteration stage times of the fp8 pipeline at 4 ranks, 131072 rows, with rank
        # 0's cProfile of the fused variant (the host time of an exchange landing in permute's order)
        [ "$ngpu" -ge 4 ] && step "stage times per iteration and profile, fp8 pipeline, 4 ranks" 300 "${mpirun_env[@]}" -n 4 \
            python3 bench/profile_step.py 131072 ${STEP_VARIANTS:-fp8_rowwise_mxgrad,fp8_rowwise} \
            ${STEP_PROFILED:-fp8_rowwise} --dim ${STEP_DIM:-7168} --hidden ${STEP_HIDDEN:-2048} --iters 20 ;;
    profile4fresh) [ "$ngpu" -ge 4 ] && step "host profile, 4 ranks, a new layout per call" 240 "${mpirun_env[@]}" -n 4 \
        python3 bench/profile_host.py ${PROFILE_ROWS:-4096} 7168 ${PROFILE_CALLS:-300} fresh ;;
    stepfp8small2)  # the same at 4096 rows (issue 11: host-bound), with rank 0's cProfile of the fp8 path
        step "stage times per iteration and profile, fp8 pipeline, 4096 rows, 2 ranks" 300 "${mpirun_env[@]}" -n 2 \
            python3 bench/profile_step.py 4096 bf16+fp8gemm,fp8_rowwise_mxgrad fp8_rowwise_mxgrad --iters 30 ;;
    fused2) step "exchanges landing in permute's order vs exchange + permute, 2 ranks" 200 \
        "${mpirun_env[@]}" -n 2 python3 bench/probe_fused.py ;;
    fused4) [ "$ngpu" -ge 4 ] && step "exchanges landing in permute's order vs exchange + permute, 4 ranks" 200 \
        "${mpirun_env[@]}" -n 4 python3 bench/probe_fused.py ;;
    ncu1)  # Nsight Compute on the fp8 wgrad conversion kernels (clocks left alone), one launch each
        step "Nsight Compute, fp8 wgrad conversion kernels" 300 ncu --clock-control none \
            -k regex:group_colwise --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
            --section SchedulerStats --section WarpStateStats --section SourceCounters \
            python3 bench/probe_colwise.py --once ;;
    gather1) step "MXFP8 -> bf16 gather beside its neighbours, one GPU" 120 python3 bench/probe_gather.py ;;
    gemm1) step "fp8 grouped GEMM pieces alone, fast accumulation or not, one GPU" 180 python3 bench/probe_gemm.py ;;
    ncugather1)  # Nsight Compute on the MXFP8 -> bf16 gather and the flat dequantize (clocks left alone)
        step "Nsight Compute, MXFP8 -> bf16 gather" 300 ncu --clock-control none \
            -k regex:"gather_dequantize|dequantize_mxfp8_bf16" --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
            --section SchedulerStats --section WarpStateStats python3 bench/probe_gather.py --once ;;
    host1) step "host path pieces, 1 rank" 180 "${mpirun_env[@]}" -n 1 python3 bench/probe_host.py ;;
    host2) step "host path pieces, 2 ranks" 180 "${mpirun_env[@]}" -n 2 python3 bench/probe_host.py ;;
    self2) step "a rank's own rows in an NCCL exchange, 2 ranks" 180 "${mpirun_env[@]}" -n 2 python3 bench/probe_self.py ;;
    self4) [ "$ngpu" -ge 4 ] && step "a rank's own rows in an NCCL exchange, 4 ranks" 180 "${mpirun_env[@]}" -n 4 python3 bench/probe_self.py ;;
    host4) [ "$ngpu" -ge 4 ] && step "host path pieces, 4 ranks" 180 "${mpirun_env[@]}" -n 4 python3 bench/probe_host.py ;;
    hostab1)  # the host probe of the tree at $AB_OLD (a source tree, e.g. git archive) and of this
        # one, alternating, twice, in one job (host timings differ between machines)
        importable "$AB_OLD"
        for round in 1 2; do
            step "host path pieces, 1 rank, OLD tree $AB_OLD (round $round)" 120 env PYTHONPATH="$AB_OLD:${PYTHONPATH:-}" \
                MXCOMM_COMMIT="${AB_OLD_COMMIT:-old}" \
                "${mpirun_env[@]}" -n 1 python3 bench/probe_host.py 4096 7168 ${AB_CALLS:-300}
            step "host path pieces, 1 rank, this tree (round $round)" 120 "${mpirun_env[@]}" -n 1 \
                python3 bench/probe_host.py 4096 7168 ${AB_CALLS:-300}
        done ;;
    colwiseab1)  # the fp8 wgrad conversion kernels of $AB_FLOAT's, $AB_OLD's (and $AB_MORE's) and this tree, one GPU
        for tree in "$AB_FLOAT" "$AB_OLD" ${AB_MORE:-}; do
            importable "$tree"
            step "fp8 wgrad conversion kernels, tree $tree" 120 env PYTHONPATH="$tree:${PYTHONPATH:-}" \
                python3 "$tree/bench/probe_colwise.py"
        done
        step "fp8 wgrad conversion kernels, this tree" 120 python3 bench/probe_colwise.py ;;
    pipeab1)  # the small-batch pipeline at 1 rank (host-bound calls), $AB_OLD's tree then this one
        importable "$AB_OLD"
        step "pipeline, 1 rank, small batches, OLD tree $AB_OLD" 200 env -C "$AB_OLD" \
            PYTHONPATH="$AB_OLD:${PYTHONPATH:-}" MXCOMM_COMMIT="${AB_OLD_COMMIT:-old}" \
            "${mpirun_env[@]}" -n 1 python3 -m mxcomm.bench pipeline --tokens 4096 16384 --dim 7168 \
            --hidden 2048 --experts 8 --no-stages --variants mxfp8,fp8_rowwise \
            --json "$res/pipeline_small_w1_old.json" --markdown "$res/pipeline_small_w1_old.md"
        step "pipeline, 1 rank, small batches, this tree" 200 "${mpirun_env[@]}" -n 1 python3 -m mxcomm.bench \
            pipeline --tokens 4096 16384 --dim 7168 --hidden 2048 --experts 8 --no-stages \
            --variants mxfp8,fp8_rowwise --json "$res/pipeline_small_w1.json" --markdown "$res/pipeline_small_w1.md" ;;
    latencyab2|smallab2|layoutab2|stepab2)  # the latency benchmark (latencyab2), the small-batch
        # pipeline (smallab2, SMALL_ROUTING), what a new layout costs (layoutab2:
        # bench/probe_layout.py, LAYOUT_ROWS) or the host time per pipeline stage (stepab2,
        # STEP_ROWS) of the tree at $AB_OLD and of this one, alternating, twice (old new, then
        # new old, so neither tree always runs second; the pipeline once unless SMALL_ROUNDS=2),
        # in one job: host timings differ between machines
        importable "$AB_OLD"
        rounds="1 2"; [ "$phase" = smallab2 ] && [ "${SMALL_ROUNDS:-1}" = 1 ] && rounds=1
        for round in $rounds; do
            order="old new"; [ "$round" = 2 ] && order="new old"
            for tree in $order; do
                # python -m puts the working directory first on sys.path: the old tree's -m runs
                # start in it (before 2026-11-27 they ran this tree's package twice)
                if [ "$tree" = old ]; then treepath=(env PYTHONPATH="$AB_OLD:${PYTHONPATH:-}" MXCOMM_COMMIT="${AB_OLD_COMMIT:-old}")
                    treemod=(env -C "$AB_OLD" PYTHONPATH="$AB_OLD:${PYTHONPATH:-}" MXCOMM_COMMIT="${AB_OLD_COMMIT:-old}")
                else treepath=(env); treemod=(env); fi
                if [ "$phase" = layoutab2 ]; then
                    step "what a new layout costs, 2 ranks, $tree tree (round $round)" 120 "${treepath[@]}" "${mpirun_env[@]}" -n 2 \
                        python3 bench/probe_layout.py ${LAYOUT_ROWS:-16384} 7168 50
                elif [ "$phase" = stepab2 ]; then
                    step "host time per pipeline stage, 2 ranks, $tree tree (round $round)" 200 "${treepath[@]}" "${mpirun_env[@]}" -n 2 \
                        python3 bench/profile_step.py ${STEP_ROWS:-16384} bf16,mxfp8 none --routing uniform
                elif [ "$phase" = latencyab2 ]; then
                    step "bench latency, 2 ranks, $tree tree (round $round)" 300 "${treemod[@]}" "${mpirun_env[@]}" -n 2 \
                        python3 -m mxcomm.bench latency ${LATENCY_ARGS:-} \
                        --json "$res/latency_ab_${tree}_w2.json" --markdown "$res/latency_ab_${tree}_w2.md"
                else
                    step "bench pipeline, 2 ranks, small batches, $tree tree" 300 "${treemod[@]}" "${mpirun_env[@]}" -n 2 \
                        python3 -m mxcomm.bench pipeline --routing ${SMALL_ROUTING:-uniform} \
                        --tokens ${SMALL_TOKENS:-4096 16384 32768 65536} --dim 7168 --hidden 2048 --experts 8 \
                        --no-stages --interleave --variants ${SMALL_VARIANTS:-mxfp8,fp8_rowwise} \
                        --json "$res/pipeline_small_ab_${tree}_${SMALL_ROUTING:-uniform}_r${round}_w2.json" \
                        --markdown "$res/pipeline_small_ab_${tree}_${SMALL_ROUTING:-uniform}_r${round}_w2.md"
                fi
            done
        done ;;
    latency1) step "bench latency, 1 rank" 300 "${mpirun_env[@]}" -n 1 python3 -m mxcomm.bench latency \
        --json "$res/latency_w1.json" --markdown "$res/latency_w1.md" ;;
    pipe2topk) step "bench pipeline, 2 ranks, small batches, topk routing" 500 "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench pipeline \
        --tokens ${SMALL_TOKENS:-4096 16384 32768 65536} --dim 7168 --hidden 2048 --experts 8 --no-stages --routing topk --interleave \
        --variants ${SMALL_VARIANTS:-mxfp8,fp8_rowwise} --json "$res/pipeline_small_topk_w2.json" --markdown "$res/pipeline_small_topk_w2.md" ;;
    latency2) step "bench latency, 2 ranks" 300 "${mpirun_env[@]}" -n 2 python3 -m mxcomm.bench latency ${LATENCY_ARGS:-} \
        --json "$res/latency_w2.json" --markdown "$res/latency_w2.md" ;;
    latency4) [ "$ngpu" -ge 4 ] && step "bench latency, 4 ranks" 300 "${mpirun_env[@]}" -n 4 python3 -m mxcomm.bench latency ${LATENCY_ARGS:-} \
        --json "$res/latency_w4.json" --markdown "$res/latency_w4.md" ;;
    converge2check|converge2|converge4)  # issue 42: examples/train_moe.py's gpu preset, ONE job on
        # the machine's GPUs (uncontended tokens/s), one seed set per call: CONVERGE_VARIANTS
        # [recipes] x CONVERGE_SEEDS [0] x CONVERGE_REPEATS [0], cut at TRAIN_MINUTES [8] (no run
        # starts that would not fit); the corpus wheel from CORPUS_DIR [bench/wheels] where it
        # lies there (pip download --no-deps transformers==4.57.1 -d bench/wheels; carried),
        # else the installed one. converge2check: 60 steps of every recipe and the attribution
        # variants, to see that all of them run here before a long call (not for the report).
        ranks=2; [ "$phase" = converge4 ] && ranks=4
        if [ "$ngpu" -lt "$ranks" ]; then echo "=== $phase: needs $ranks GPUs, $ngpu here" | tee -a "$log"; continue; fi
        corpus=(); ls "${CORPUS_DIR:-bench/wheels}"/transformers-4.57.1-*.whl >/dev/null 2>&1 \
            && corpus=(--corpus-dir "${CORPUS_DIR:-bench/wheels}")
        batch=(); [ "$ranks" = 4 ] && batch=(--batch 8)   # the same 16384 tokens a step, < 1 epoch
        if [ "$phase" = converge2check ]; then
            step "train_moe check: every recipe and attribution variant, 60 steps, 2 ranks" 560 \
                "${mpirun_env[@]}" -n 2 python3 examples/train_moe.py "${corpus[@]}" --seeds 0 \
                --variants recipes,recipe:auto,attribution:fp8_rowwise,attribution:mxfp8 \
                --steps 60 --warmup 10 --eval-every 20 --log-every 20 --max-minutes 8 \
                --json "$res/converge_check_w2.json" --markdown "$res/converge_check_w2.md"
            continue
        fi
        variants=${CONVERGE_VARIANTS:-recipes}
        tag="w${ranks}_s${CONVERGE_SEEDS:-0}_r${CONVERGE_REPEATS:-0}_$(echo "$variants" | tr -c 'A-Za-z0-9\n' '-')"
        step "train_moe convergence, $ranks ranks: $variants, seeds ${CONVERGE_SEEDS:-0}, repeats ${CONVERGE_REPEATS:-0}" \
            $(( ${TRAIN_MINUTES:-8} * 60 + 60 )) "${mpirun_env[@]}" -n "$ranks" python3 examples/train_moe.py \
            "${corpus[@]}" "${batch[@]}" --variants "$variants" --seeds "${CONVERGE_SEEDS:-0}" \
            --repeats "${CONVERGE_REPEATS:-0}" --max-minutes "${TRAIN_MINUTES:-8}" \
            --json "$res/converge_$tag.json" --markdown "$res/converge_$tag.md" ;;
    profile2) step "host profile, 2 ranks" 240 "${mpirun_env[@]}" -n 2 python3 bench/profile_host.py ${PROFILE_ROWS:-4096} 7168 ${PROFILE_CALLS:-300} ;;
    step2) for routing in uniform topk; do  # where a pipeline step's host time goes, per stage
        step "host time per pipeline stage, 2 ranks, $routing routing" 240 "${mpirun_env[@]}" -n 2 \
            python3 bench/profile_step.py ${STEP_ROWS:-4096} bf16,mxfp8 mxfp8 --routing $routing; done ;;
    step4) [ "$ngpu" -ge 4 ] && step "host time per pipeline stage, 4 ranks, uniform routing" 240 "${mpirun_env[@]}" -n 4 \
        python3 bench/profile_step.py ${STEP_ROWS:-4096} bf16,mxfp8 mxfp8 --routing uniform ;;
    steppieces2) for rows in ${STEP_ROWS:-4096 16384}; do  # each stage's pieces of the host path
            step "host path pieces of a pipeline step, 2 ranks, $rows rows" 240 "${mpirun_env[@]}" -n 2 \
            python3 bench/profile_step.py $rows bf16,mxfp8 none --pieces --routing uniform; done ;;
    profile2fresh) step "host profile, 2 ranks, a new layout per call" 240 "${mpirun_env[@]}" -n 2 \
        python3 bench/profile_host.py ${PROFILE_ROWS:-4096} 7168 ${PROFILE_CALLS:-300} fresh ;;
    soak2) step "soak, 2 ranks" 300 "${mpirun_env[@]}" -n 2 python3 bench/soak.py --calls ${SOAK_CALLS:-1667} ;;
    torch1) step "torch.distributed and torchtitan gpu tests, 1 process" 300 python3 -m pytest -q -p no:cacheprovider \
        -m "gpu and not mpi" tests/test_torchdist.py tests/test_torchtitan.py ;;
    titan2) step "torchtitan MoE layer with mxcomm's dispatcher under torchrun, 2 GPUs" 300 \
        torchrun --nproc-per-node 2 tests/torchrun_torchtitan.py ;;
    titanbench2|titanbench4)  # torchtitan's MoE layer (DeepSeek-V3 671B dims) fwd + bwd: its bf16 and
        # float8 experts vs mxcomm's, eager and compiled; torchtitan and torchao from TITAN_SITE
        # (installed there with --no-deps); one run per TITAN_TOKENS value (tokens per rank,
        # default 4096 16384), so a run cut short keeps the shapes it finished
        n=${phase#titanbench}
        [ "$ngpu" -ge "$n" ] && for tokens in ${TITAN_TOKENS:-4096 16384}; do
            step "bench torchtitan, $n ranks, $tokens tokens per rank" 560 \
                env PYTHONPATH="${TITAN_SITE:-/tmp/site}:${PYTHONPATH:-}" torchrun --nproc-per-node "$n" \
                -m mxcomm.bench torchtitan --tokens "$tokens" --iters ${TITAN_ITERS:-20} \
                --json "$res/torchtitan_${tokens}_w$n.json" --markdown "$res/torchtitan_${tokens}_w$n.md"
        done ;;
    titanab2)  # torchtitan's layer (671B dims), 2 GPUs, TITAN_TOKENS (default 16384) per rank:
        # mxcomm's fp8_rowwise without the backward overlap; with it (eager: it is eager only);
        # fp8_rowwise_gradbf16 (the expert weight gradients' recipe); each run times its own
        # torchtitan_bf16 reference beside it
        [ "$ngpu" -ge 2 ] && for tokens in ${TITAN_TOKENS:-16384}; do
            for spec in "fp8_rowwise:--mxcomm-overlap off" "fp8_rowwise:--mxcomm-overlap on --modes eager" \
                        "fp8_rowwise_gradbf16:"; do
                recipe=${spec%%:*}; extra=${spec#*:}; tag=$recipe
                case $extra in *"overlap on"*) tag=${recipe}_overlap ;; esac
                step "bench torchtitan A/B, 2 ranks, $tokens tokens per rank, $recipe $extra" 560 \
                    env PYTHONPATH="${TITAN_SITE:-/tmp/site}:${PYTHONPATH:-}" torchrun --nproc-per-node 2 \
                    -m mxcomm.bench torchtitan --tokens "$tokens" --iters ${TITAN_ITERS:-20} \
                    --variants torchtitan_bf16 mxcomm --mxcomm-recipe "$recipe" $extra \
                    --json "$res/torchtitan_${tag}_${tokens}_w2.json" \
                    --markdown "$res/torchtitan_${tag}_${tokens}_w2.md"
            done
        done ;;
    torchrun2) step "pipeline under torchrun, 2 ranks" 400 torchrun --nproc-per-node 2 -m mxcomm.bench pipeline \
        --tokens 16384 --dim 7168 --hidden 2048 --experts 8 --no-stages \
        --json "$res/pipeline_torchrun_w2.json" --markdown "$res/pipeline_torchrun_w2.md" ;;
    nodestransport4)  # issue 43: hier against grouped across 2 emulated nodes x 2 (socket threads
        # raised): the pipeline with its stages timed one by one, --peer-memory on (hier) then off
        # (grouped, NCCL's own split), one job each on the same host, NODES_ROUNDS times (ABAB...):
        # which transport, and which stage, differs beyond the jobs' spread
        [ "$ngpu" -ge 4 ] && for round in $(seq ${NODES_ROUNDS:-1}); do for pm in on off; do
            step "bench pipeline with stages, 2 emulated nodes x 2, --peer-memory $pm, round $round" 300 \
                "${raised[@]}" "${emulated[@]}" -x NCCL_SOCKET_NTHREADS -x NCCL_NSOCKS_PERTHREAD -n 4 \
                bash -c "$per_node" _ \
                python3 -m mxcomm.bench pipeline --peer-memory $pm --tokens ${NODES_TOKENS:-16384 131072} \
                --dim 7168 --hidden 2048 --experts 8 --interleave --iters ${PIPE_ITERS:-10} --warmup 2 \
                --variants ${NODES_VARIANTS:-fp8_rowwise,mxfp8} $([ "${NODES_STAGES:-1}" = 0 ] && echo --no-stages) \
                --json "$res/pipeline_nodes2x2_stages_pm${pm}_$round.json" \
                --markdown "$res/pipeline_nodes2x2_stages_pm${pm}_$round.md"
        done; done ;;
    tracenodes4)  # issue 43: one step of the layer across 2 emulated nodes x 2 (socket threads
        # raised) as a timeline per rank (profile_step --trace): which stream waits on what
        [ "$ngpu" -ge 4 ] && step "profile_step --trace, 2 emulated nodes x 2" 200 "${raised[@]}" \
            "${emulated[@]}" -x NCCL_SOCKET_NTHREADS -x NCCL_NSOCKS_PERTHREAD -n 4 bash -c "$per_node" _ \
            python3 bench/profile_step.py ${NODES_TOKENS:-16384} bf16,fp8_rowwise none --iters 8 \
            --peer-memory ${PEER_MEMORY:-auto} --trace-steps 2 --trace "$res/trace_nodes2x2" ;;
    wire4)  # issue 43: mxcomm's exchanges against torch's all_to_all_single moving the same bytes,
        # across 2 emulated nodes x 2 (socket threads raised), --peer-memory auto then off
        [ "$ngpu" -ge 4 ] && for pm in auto off; do
            step "probe_wire, 2 emulated nodes x 2, --peer-memory $pm" 200 "${raised[@]}" "${emulated[@]}" \
                -x NCCL_SOCKET_NTHREADS -x NCCL_NSOCKS_PERTHREAD -n 4 bash -c "$per_node" _ \
                python3 bench/probe_wire.py --peer-memory $pm --rows ${NODES_TOKENS:-16384 131072} \
                --iters ${PIPE_ITERS:-10}
        done ;;
    wireone4)  # probe_wire on one node, 4 ranks (NVLink): does a second send per peer in one NCCL
        # group cost there too (the call header before the rows; bench/NOTES.md, 2026-11-28)?
        [ "$ngpu" -ge 4 ] && step "probe_wire, one node, 4 ranks" 200 "${mpirun_env[@]}" -n 4 \
            python3 bench/probe_wire.py --rows ${WIRE_ROWS:-4096 16384 131072} --iters ${PIPE_ITERS:-10} ;;
    nodes4)  # 4 GPUs as 2 emulated nodes x 2: MXCOMM_NODE_SIZE=2 for mxcomm, NCCL_HOSTID=node<k>
        # per pair for torch's NCCL and mxcomm's alike (NCCL's host hash), so both take NVLink
        # inside a pair and NCCL's socket transport between pairs (IB off). The drop-in against
        # torch's bf16 all_to_all_single with socket defaults, then with the socket threads
        # raised (SOCKET_NTHREADS x NSOCKS_PERTHREAD); the pipeline by recipe with them raised
        # (NODES_A2A=0 NODES_PIPELINE=0: the tests alone).
        if [ "$ngpu" -lt 4 ]; then echo "=== $phase: needs 4 GPUs, $ngpu here" | tee -a "$log"; continue; fi
        step "gpu tests of the emulated nodes, 4 ranks" 300 "${mpirun_env[@]}" --output-filename "$OUT/ranks-nodes4" \
            -n 4 python3 -m pytest -q -rfE -p no:cacheprovider -o faulthandler_timeout=200 \
            -W ignore::DeprecationWarning --with-mpi -m "gpu and mpi" tests/test_nodes.py
        [ "${NODES_A2A:-1}" = 1 ] && step "bench a2a, 2 emulated nodes x 2, NCCL socket defaults" 400 "${emulated[@]}" -n 4 \
            bash -c "$per_node" _ python3 -m mxcomm.bench a2a --rows 4096 16384 --dim 7168 \
            --json "$res/a2a_nodes2x2_default.json" --markdown "$res/a2a_nodes2x2_default.md"
        [ "${NODES_A2A:-1}" = 1 ] && step "bench a2a, 2 emulated nodes x 2, socket threads raised" 400 env NCCL_SOCKET_NTHREADS=${SOCKET_NTHREADS:-8} \
            NCCL_NSOCKS_PERTHREAD=${NSOCKS_PERTHREAD:-4} "${emulated[@]}" -x NCCL_SOCKET_NTHREADS -x NCCL_NSOCKS_PERTHREAD \
            -n 4 bash -c "$per_node" _ python3 -m mxcomm.bench a2a --rows 4096 16384 --dim 7168 \
            --json "$res/a2a_nodes2x2_threads.json" --markdown "$res/a2a_nodes2x2_threads.md"
        [ "${NODES_PIPELINE:-1}" = 1 ] && step "bench pipeline by recipe, 2 emulated nodes x 2, socket threads raised" 500 \
            env NCCL_SOCKET_NTHREADS=${SOCKET_NTHREADS:-8} NCCL_NSOCKS_PERTHREAD=${NSOCKS_PERTHREAD:-4} \
            "${emulated[@]}" -x NCCL_SOCKET_NTHREADS -x NCCL_NSOCKS_PERTHREAD -n 4 bash -c "$per_node" _ \
            python3 -m mxcomm.bench pipeline --tokens 16384 131072 --dim 7168 --hidden 2048 --experts 8 \
            --no-stages --interleave --iters ${PIPE_ITERS:-12} --warmup 3 \
            --variants ${NODES_VARIANTS:-mxfp8,fp8_rowwise,fp8_rowwise_mxcombine} \
            --json "$res/pipeline_nodes2x2.json" --markdown "$res/pipeline_nodes2x2.md" ;;
    *) echo "unknown phase $phase" | tee -a "$log" ;;
    esac
done
