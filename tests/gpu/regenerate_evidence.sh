#!/usr/bin/env bash
# Regenerate the committed evidence, one group at a time (each writes whole files with provenance):
#   bash tests/gpu/regenerate_evidence.sh GROUP [ROOT]      (ROOT default: the checkout; files go to ROOT/evidence/)
# GROUP: parity | robustness | kernels | trainer | rollout | acceptance | realshape | realshape48 | largeshapes | longctx | bench | sweep | rl |
#        flat | flatcover | throughput | default | pgpreview | space | tailprofile | colocated | decodetiles | widedecode | truncselect |
#        attntiles | ropeqk | qknormrope | silu | siluup | densetiles | attnsplits | flatloop | prefillflat | segtma | segsmem | prefillchoice |
#        prefilltiles | moetiles | moeorder | v1gap | v1rows | moeparity | tilechoice | sampler | segsplit | contracts | w2 | stockmoe | tp2 | pp2 (two GPUs each) | all (the one-GPU groups but realshape48, flat, flatcover, throughput,
#        default, pgpreview, space, tailprofile, stockmoe,
#        decodetiles, widedecode, truncselect, attntiles, ropeqk, qknormrope, silu, siluup, densetiles, attnsplits, flatloop,
#        prefillflat, segtma, segsmem, prefillchoice, prefilltiles, moetiles, moeorder, v1gap, v1rows, moeparity, tilechoice, sampler, segsplit, contracts and w2)
# realshape48 builds the full 48-layer 30B-A3B geometry (a 57 GB checkpoint): on a host whose disk
# cannot hold it, point TRUE_ON_POLICY_CACHE at a tmpfs (e.g. /dev/shm/tpo-cache) first.
# On a copy without .git, export TRUE_ON_POLICY_GIT_COMMIT=<the commit it was made from> first.
set -uo pipefail
cd "$(dirname "$0")/../.."
GROUP=${1:?usage: regenerate_evidence.sh GROUP [ROOT]}
E=${2:-.}/evidence
mkdir -p "$E"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "from importlib.metadata import entry_points as e; assert any(x.name == 'true_on_policy' for x in e(group='sglang.srt.plugins'))" 2>/dev/null \
  || bash tests/gpu/dev_install.sh || exit 1
# PARITY_MEM=F: every parity line's --mem (SGLang's mem_fraction_static; the harness's default 0.5 leaves an 80 GB
# card no room for the 48-layer checkpoint's 57 GB of weights: 0.85 there)
P="python3 -m true_on_policy.harness.parity --prompts 64 --new-tokens 64${PARITY_MEM:+ --mem $PARITY_MEM}"
# the files without "flat" or "pg" in their names hold the tree-width-8 contract, the default until 2026-12-01:
# named here, so that they regenerate as they were made (the flat contract is the default now)
V1="--contract qwen3_moe_true_on_policy_v1"
# the large layer shapes' parity traffic (2 layers): mixed lengths plus a 4096-token prompt chunked at 2048, then 8
# radix-cache hits, at T = 1
LARGE="--temperature 1.0 --long-prompts 1 --long-len 4096 --chunked-prefill-size 2048 --radix-followups 8"
# the 30B-A3B geometry's parity traffic (48 layers, some lines 6 first): mixed lengths plus two 8192-token prompts
# chunked at 4096, then 8 radix-cache hits, at T = 1, CUDA graphs up to 80 sequences
DEEP="--temperature 1.0 --long-prompts 2 --long-len 8192 --radix-followups 8 --chunked-prefill-size 4096"
DEEP+=" --cuda-graph-max-bs 80"
# XDIST=N: the tier's tests in N pytest-xdist workers on the one GPU (the kernel groups are bound by Triton's
# compiles, which then run in parallel); the controller writes the one gpu-tier.json. Under --dist loadgroup the tests
# marked xdist_group("big_gpu_memory") run one after another in one worker, and every worker frees its cached blocks
# after each test (tests/conftest.py), so that the card holds the one big test and the small ones beside it
tier() { local dir=$1; shift; TRUE_ON_POLICY_EVIDENCE_DIR="$E/$dir" python3 -m pytest -m gpu -q -p no:cacheprovider \
  ${XDIST:+-n "$XDIST" --dist loadgroup} "$@"; }
rc=0
# a geometry by name, a big layer shape (a22b, a35b) at the depth that fits this card: its H200 depth on a card of
# over 100 GB, else its H100 depth
depth() { case $1 in
  a22b|a35b) [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] \
    && echo "$1_h200" || echo "$1_h100" ;;
  *) echo "$1" ;; esac; }
run() { "$@" || { rc=1; echo "FAILED: $*"; }; }
case $GROUP in
  parity|all)
    run $P --mode tpo --trainer patched $V1 --geometry embedded --temperature 1.0 --out "$E/parity-tpo-embedded-t1.0.json"
    run $P --mode tpo --trainer patched $V1 --geometry embedded --temperature 0.7 --out "$E/parity-tpo-embedded-t0.7.json"
    run $P --mode tpo --trainer patched $V1 --geometry wide --temperature 1.0 --out "$E/parity-tpo-wide-t1.0.json"
    run $P --mode tpo --trainer patched $V1 --geometry wide --temperature 0.7 --out "$E/parity-tpo-wide-t0.7.json"
    run $P --mode stock --trainer hf --geometry embedded --temperature 1.0 --out "$E/parity-stock-embedded-t1.0.json"
    run $P --mode stock --trainer hf --geometry wide --temperature 0.7 --out "$E/parity-stock-wide-t0.7.json" ;;&
  realshape|all)  # the Qwen3-30B-A3B layer geometry, 6 layers (random bf16 weights, built on the GPU)
    run $P --mode tpo --trainer patched $V1 --geometry a3b6 --temperature 1.0 --out "$E/parity-tpo-a3b6-t1.0.json"
    run $P --mode stock --trainer hf --geometry a3b6 --temperature 1.0 --out "$E/parity-stock-a3b6-t1.0.json" ;;&
  realshape48)  # the full depth: ≥ 8k-token prompts in a mixed batch, chunked prefill, radix-cache hits
    run $P --mode tpo --trainer patched $V1 --geometry a3b48 $DEEP --out "$E/parity-tpo-a3b48-t1.0.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 --variants stock deterministic tpo_v1 \
      --new-tokens 256 --one-engine --mem 0.85 --repeats 1 --passes 3 --out "$E/throughput-a3b48.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry a3b48 --variants stock tpo_v1 --out "$E/profile-a3b48.json" ;;
  largeshapes|all)  # the 235B-A22B and Coder-480B-A35B layer geometries, 2 layers each (~12 and ~34 GB)
    for g in a22b2 a35b2; do  # mixed lengths plus a 4096-token prompt, chunked at 2048, then 8 radix-cache hits
      run $P --mode tpo --trainer patched $V1 --geometry $g $LARGE --out "$E/parity-tpo-$g-t1.0.json"
    done ;;&
  longctx|all)  # YaRN x8 from 32768 to 262144 positions (tiny layers): a 262000-token prompt in the mixed batch,
    # chunked at 8192, then 8 radix-cache hits; split-KV decode past 256k keys
    run $P --mode tpo --trainer patched $V1 --geometry yarn262k --temperature 1.0 --long-prompts 1 --long-len 262000 \
      --chunked-prefill-size 8192 --radix-followups 8 --out "$E/parity-tpo-yarn262k-t1.0.json" ;;&
  rl|all) run python3 -m true_on_policy.harness.rl_loop $V1 --steps 100 --out "$E/rl-loop-embedded.json" ;;&
  kernels|all) run tier gpu-tier-kernels tests/gpu/test_kernels_gpu.py tests/gpu/test_sampling_gpu.py ;;&
  trainer|all) run tier gpu-tier-trainer tests/gpu/test_trainer_gpu.py ;;&
  rollout|all) run tier gpu-tier-rollout tests/gpu/test_engine_gpu.py tests/gpu/test_server_gpu.py \
                 tests/gpu/test_rollout_gpu.py tests/gpu/test_sampling_http_gpu.py tests/gpu/test_sampling_engine_gpu.py \
                 tests/gpu/test_guard_gpu.py ;;&
  acceptance|all) run python3 -m true_on_policy.harness.acceptance $V1 --folder "$E/acceptance-embedded" --resume \
                    --out "$E/acceptance-embedded.json" ;;&
  bench|all)
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/kernels.py --tokens 1 64 256 4096 --out "$E/bench-kernels.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry a3b6 --variants stock tpo_v1 --out "$E/profile-a3b6.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b6 --out "$E/throughput-a3b6.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/trainer_speed.py --geometry a3b6 $V1 --out "$E/trainer-speed-a3b6.json" ;;
  sweep)  # every GEMM of a layer and the prefill glue kernels: candidates' time and bits against the forms in use
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --out "$E/bench-layer-gemms.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms o_proj --tokens 1 64 256 4096 16384 \
      --out "$E/bench-oproj-planes.json"
    # the plain GEMMs and the flat down projection with their weights from HBM (8 copies): the tile tables
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms o_proj_flat qkv router down_flat \
      --tokens 1 64 256 4096 --copies 8 --out "$E/bench-tiles.json"
    # the decode tiles from the geometry against the fixed ones (matmul.DECODE_TILES), alternated in one run, weights
    # from HBM, bits compared: qkv, o_proj, router, gate/up and down of 30B-A3B, 235B-A22B and h1536e256k6
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/decode_tiles.py --out "$E/bench-decode-tiles.json" ;;
  flat)  # the tree-width-1 contract: parity at 6 and 48 layers (as realshape/realshape48), 48-layer throughput and profile
    F="--contract qwen3_moe_true_on_policy_flat_v1"
    run $P --mode tpo --trainer patched $F --geometry a3b6 --temperature 1.0 --out "$E/parity-tpo-flat-a3b6-t1.0.json"
    run $P --mode tpo --trainer patched $F --geometry a3b48 $DEEP --out "$E/parity-tpo-flat-a3b48-t1.0.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 --variants stock tpo_v1 tpo_flat \
      --new-tokens 256 --one-engine --mem 0.85 --repeats 1 --passes 3 --out "$E/throughput-flat-a3b48.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry a3b48 --variants stock tpo_v1 tpo_flat \
      --out "$E/profile-flat-a3b48.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/kernels.py --tree-width 1 --tokens 1 64 256 4096 \
      --out "$E/bench-kernels-flat.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/trainer_speed.py --geometry a3b6 \
      --contract qwen3_moe_true_on_policy_flat_v1 --out "$E/trainer-speed-flat-a3b6.json"
    # every rollout claim (graphs, chunking, batch and interleaving invariance, radix hits, repeats) under the flat contract
    run python3 -m true_on_policy.harness.acceptance $F --folder "$E/acceptance-flat-embedded" --resume \
      --out "$E/acceptance-flat-embedded.json" ;;
  flatcover)  # the flat contract where only the main one has evidence: the tiny geometries at T=0.7, the 235B and
    # 480B layer shapes, YaRN to 262k positions and the 100-step RL loop with weight pushes (as parity, largeshapes,
    # longctx and rl); what the flat contract needs before it can be the default (README, Contracts)
    F="--contract qwen3_moe_true_on_policy_flat_v1"
    run $P --mode tpo --trainer patched $F --geometry embedded --temperature 0.7 --out "$E/parity-tpo-flat-embedded-t0.7.json"
    run $P --mode tpo --trainer patched $F --geometry wide --temperature 0.7 --out "$E/parity-tpo-flat-wide-t0.7.json"
    for g in a22b2 a35b2; do
      run $P --mode tpo --trainer patched $F --geometry $g $LARGE --out "$E/parity-tpo-flat-$g-t1.0.json"
    done
    run $P --mode tpo --trainer patched $F --geometry yarn262k --temperature 1.0 --long-prompts 1 --long-len 262000 \
      --chunked-prefill-size 8192 --radix-followups 8 --out "$E/parity-tpo-flat-yarn262k-t1.0.json"
    run python3 -m true_on_policy.harness.rl_loop $F --steps 100 --out "$E/rl-loop-flat-embedded.json" ;;
  throughput)  # the prompts computed in every pass (--prefix-cache cold, the default), over the Engine and over HTTP;
    # stock both as shipped and with its prefill graphs off (the ratios' bar is the faster: fastest_stock); each line
    # fits one 600 s device call on one H200 (a server or engine start is ~50-145 s, so at most four variants)
    # (--resume: a line cut short continues where it stopped when run again from the same source)
    T="env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --one-engine --repeats 1 --passes 3 --resume"
    run $T --geometry a3b6 --variants stock stock_eager_prefill tpo_flat tpo_v1 --mem 0.5 --out "$E/throughput-cold-a3b6.json"
    run $T --geometry a3b6 --variants stock tpo_flat stock_eager_prefill tpo_v1 --mem 0.5 --http \
      --out "$E/throughput-http-cold-a3b6.json"
    run $T --geometry a3b48 --variants stock tpo_flat stock_eager_prefill tpo_v1 --new-tokens 256 --mem 0.85 --http \
      --out "$E/throughput-http-cold-a3b48.json"
    # the sampling a real Qwen3 checkpoint asks for (its generation_config.json, applied to every request): truncated draws
    run $T --geometry a3b48 --variants stock tpo_flat tpo_v1 --new-tokens 256 --mem 0.85 --http \
      --generation-config '{"top_k": 20, "top_p": 0.95}' --out "$E/throughput-http-cold-a3b48-qwen3-sampling.json"
    # (traces, tens of MB each, stay outside evidence/; the GPU busy/idle summary of them is evidence)
    run $T --geometry a3b48 --variants stock tpo_flat --new-tokens 256 --mem 0.85 --trace /tmp/tpo-traces-a3b48 \
      --out "$E/throughput-cold-a3b48.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/trace_gaps.py /tmp/tpo-traces-a3b48 --out "$E/trace-gaps-cold-a3b48.json" ;;
  default)  # issue 14's acceptance for what --true-on-policy runs now (DEFAULT_CONTRACT, no contract flag): throughput
    # over HTTP with the prompts computed, against stock and SGLang's deterministic mode in the same run, at 6 and 48
    # layers, then parity at both (each throughput line ran in one 600 s device call: 546 s and 496 s)
    T="env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --one-engine --repeats 1 --passes 3 --resume"
    run $T --geometry a3b6 --variants stock deterministic tpo tpo_no_logprob tpo_v1 --mem 0.5 --http \
      --out "$E/throughput-http-cold-a3b6-default.json"
    run $T --geometry a3b48 --variants stock deterministic tpo --new-tokens 256 --mem 0.85 --http \
      --out "$E/throughput-http-cold-a3b48-default.json"
    run $P --mode tpo --trainer patched --geometry a3b6 --temperature 1.0 --out "$E/parity-tpo-default-a3b6-t1.0.json"
    run $P --mode tpo --trainer patched --geometry a3b48 $DEEP --out "$E/parity-tpo-default-a3b48-t1.0.json" ;;
  pgpreview)  # SGLang's prefill CUDA graphs under the overlay (the previews of v1 and flat): 48-layer throughput over
    # HTTP against stock as shipped, then parity at 48 layers (chunked prefill, radix hits) and every rollout claim
    T="env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --one-engine --repeats 1 --passes 3 --resume"
    run $T --geometry a3b48 --variants stock tpo_flat_pg tpo_pg --new-tokens 256 --mem 0.85 --http \
      --out "$E/throughput-http-cold-a3b48-pg.json"
    for c in flat_pg pg; do  # at 6 layers first (a 7 GB checkpoint, ~2 min each), then at 48
      run $P --mode tpo --trainer patched --contract qwen3_moe_true_on_policy_${c}_preview_v1 --geometry a3b6 \
        $DEEP --out "$E/parity-tpo-${c}-a3b6-t1.0.json"
    done
    for c in flat_pg pg; do
      run $P --mode tpo --trainer patched --contract qwen3_moe_true_on_policy_${c}_preview_v1 --geometry a3b48 \
        $DEEP --out "$E/parity-tpo-${c}-a3b48-t1.0.json"
    done
    run python3 -m true_on_policy.harness.acceptance --contract qwen3_moe_true_on_policy_flat_pg_preview_v1 \
      --folder "$E/acceptance-flat-pg-embedded" --resume --out "$E/acceptance-flat-pg-embedded.json" ;;
  stockmoe)  # issue 37: stock SGLang's fused-MoE tiles tuned for each geometry's shape on this GPU (benchmarks/stock_moe.py:
    # the candidates, SGLang's default and the fastest per batch, every time), the tiles the stock_moe variants run;
    # GEOMETRY=<g> names one. No checkpoint: random weights of the shape
    for g in ${GEOMETRY:-a22b_h200 a35b_h200 h3072e64k4 h1536e256k6 a3b48}; do
      run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/stock_moe.py --geometry "$g" --out "$E/stock-moe-$g.json"
    done ;;
  space|tailprofile)  # issue 37: the geometries of benchmarks/geometries.py (GEOMETRY=<name>: one of them; one run
    # each; by default five, the two big layer shapes at an H200's depth: on an 80 GB card name a22b_h100 and
    # a35b_h100 instead, or a22b and a35b for the depth that fits the card), their checkpoints in RAM (--make-room
    # drops the other geometries' ones first). space: throughput of the
    # workloads plain, qwen (Qwen3's top_k/top_p in every request), tail (RL-like lengths) and long over HTTP, one engine
    # at a time, stock (its flashinfer sampling for qwen, SGLang's own backend choice, and both with the MoE tiles tuned
    # for the shape, stock_moe and stock_fi_moe) against both contracts, each
    # line to the end; TIME_BUDGET=S (for time-limited calls) stops a line before a step that would end after S seconds,
    # with exit 3 and "INCOMPLETE": run it again until the file is complete.
    # WORKLOADS / VARIANTS narrow a space or tailprofile run (the file records what ran), SPACE_TAG names its file
    # throughput-space-<g>-<tag>.json (a run at new code beside an earlier file).
    # tailprofile: GPU time per op of a decode step at batch 1, 4, 16, 64, T = 1 and Qwen3's sampling, with every sort,
    # allocation or host sync a contract's step adds to stock's (its tables in the JSON's "table"; PROFILE_TAG=before|after names the files;
    # PROFILE_MEM: every engine's memory fraction, 0.85 unless set: a35b_h100's stock needs 0.75 for the profile's prefill;
    # each variant is kept once done, with the provenance of its own run: run it again after a time limit). --resume
    # reads the file at its --out, so the rerun must find the partial file there: keep ROOT at its default (the
    # checkout's evidence/) and, where each run starts from a fresh copy of the checkout, put the partial file back into
    # its evidence/ first; a ROOT that starts empty resumes nothing and measures stock again.
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    B="env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks"
    for g in ${GEOMETRY:-a3b48 a22b_h200 a35b_h200 h3072e64k4 h1536e256k6}; do
      g=$(depth "$g")
      if [ "$GROUP" = space ]; then
        run $B/throughput.py --geometry "$g" --workload ${WORKLOADS:-plain qwen tail long} \
          --variants ${VARIANTS:-stock stock_fi stock_moe stock_fi_moe stock_flashinfer stock_auto tpo tpo_v1} --new-tokens 256 --one-engine --repeats 1 --mem 0.85 \
          --http --make-room --resume ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} \
          --out "$E/throughput-space-$g${SPACE_TAG:+-$SPACE_TAG}.json"
      else
        run $B/op_profile.py --geometry "$g" --batches 1 4 16 64 --workload ${WORKLOADS:-plain qwen} \
          --variants ${VARIANTS:-stock stock_fi tpo tpo_v1} --mem ${PROFILE_MEM:-0.85} --make-room --resume \
          --out "$E/profile-tail-$g${PROFILE_TAG:+-$PROFILE_TAG}.json"
      fi
    done ;;
  decodetiles)  # issue 37: every decode tile bitwise the fixed path (plain, grouped and tree GEMMs, three geometries, 1 to
    # 4096 rows), then the decode tiles against the fixed ones, alternated, bits checked: what decides
    # kernels.matmul.DECODE_TILES (XDIST=8 runs the tests in 8 workers)
    run tier gpu-tier-decode-tiles tests/gpu/test_kernels_gpu.py \
      -k "decode_tiles or tma or grouped or moe or width_1 or seg_tree or split_planes or tree_flat or wide_decode"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/decode_tiles.py --out "$E/bench-decode-tiles.json" ;;&
  widedecode)  # issue 37, v1: only matmul.wide_decode (the down projection's 320-column segments at decode): its
    # tile bitwise the flat loop (TP 1 and 2; decodetiles' tier runs it too), then the bench line below
    run tier gpu-tier-wide-decode tests/gpu/test_kernels_gpu.py -k "wide_decode or (seg_tree_equals_flat and 2560)" ;;&
  decodetiles|widedecode)  # Coder-480B-A35B's down projections: v1's segments too wide for ROW_SEG's stages
    # (matmul.wide_decode), timed against the flat loop, bits checked
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/decode_tiles.py --geometries a35b_h100 \
      --gemms down down_tree --out "$E/bench-decode-tiles-a35b.json" ;;&
  truncselect)  # issue 37: the selection kernel and the top-k form against the sort, bitwise (truncate; sample and the
    # trainer with the switch on and off and with and without the host bound at batches 1-256; CUDA-graph replays), then
    # the speed of the three alone and in sample, and the fraction of a batch-256 decode step the sampler's form takes
    run tier gpu-tier-truncselect tests/gpu/test_truncation_select_gpu.py tests/gpu/test_truncation_top_gpu.py
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/truncation.py --batches 1 16 64 256 --step-ms 28.0 \
      --out "$E/bench-truncation.json" ;;&
  attntiles)  # issue 37: every candidate attention launch tile (one warp, 16 or 32 rows, 1-3 stages, split or not)
    # against the fixed tile, bitwise, over the benchmark geometries' head groups, and the start-up choice among them
    # (choose_decode_tiles) against the fixed tile; then decode attention, stock SGLang against the fixed tile and each
    # candidate, alternated, bits checked (XDIST=8 runs the tests in 8 workers)
    run tier gpu-tier-attention-tiles tests/gpu/test_kernels_gpu.py -k attention_tiles
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/attention_decode.py --out "$E/bench-attention-decode.json" ;;
  ropeqk)  # issue 37: q and k rotated in one launch with SGLang's fused K/V write, bitwise apply_rope of each and the
    # cache rows written, four head layouts (the flat group's a3b48 parity line runs it inside a server)
    run tier gpu-tier-rope-qk tests/gpu/test_kernels_gpu.py -k rope ;;
  qknormrope)  # issue 37: the QK-norm inside the RoPE launch (the default; TRUE_ON_POLICY_QK_NORM_ROPE=separate: not): its
    # kernel bits (the RoPE and RMSNorm tests, which share its bodies; rmsnorm then RoPE bit for bit at five layouts;
    # and the one-launch expert table of a decode step, which every tpo variant below runs),
    # the h1536 truncation stress with it inside a server, h1536e256k6's plain and tail cells, stock, tpo and
    # tpo_qksep alternated (resumable; the files at bf2c6c1 hold tpo, the separate norm then, and tpo_qknr), the
    # lm_head and expert-table sweep, and the tail profile of the three (the silu group runs the 48-layer parity with it)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-qk-norm-rope tests/gpu/test_kernels_gpu.py -k "rope or rmsnorm or align_is"
    run env TRUE_ON_POLICY_QK_NORM_ROPE=fused python3 -m true_on_policy.harness.stress --geometry h1536 \
      --out "$E/stress-truncation-h1536-qknr.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry h1536e256k6 --workload plain tail \
      --variants stock tpo tpo_qksep --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-h1536e256k6-qknr.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --tokens 1 4 16 64 256 --gemms lm_head align \
      --out "$E/gemm-sweep-lm-head-align.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry h1536e256k6 --batches 1 4 16 64 \
      --workload plain --variants stock tpo tpo_qksep --mem 0.85 --make-room --resume \
      --out "$E/profile-tail-h1536e256k6-qknr.json" ;;
  silu)  # issue 37, at 0b8e0f2: silu(gate) * up formed in the flat down projection's load at decode, the default then,
    # measured slower and since removed: its files ran at that commit (check it out to re-run them as they ran; their
    # tpo is that form). Its bits against silu_mul then the GEMM with the decode tiles of the plain GEMMs (the lm_head's
    # too) and the one-launch expert table; the 48-layer parity; a3b48's plain and tail, stock against tpo; after the
    # 48-layer checkpoint is dropped from RAM, the tail profile of h1536e256k6 (stock, tpo, tpo_silusep) and its plain
    # and tail cells (stock, tpo_silusep: the silu's own launch, the default since)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-silu-down tests/gpu/test_kernels_gpu.py -k "silu_in_down or decode_tiles_equal_pointer or align_is"
    run $P --mode tpo --trainer patched --geometry a3b48 $DEEP --out "$E/parity-tpo-silu-a3b48-t1.0.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 --workload plain tail \
      --variants stock tpo --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-a3b48-silu.json"
    rm -rf "$TRUE_ON_POLICY_CACHE"/qwen3-moe-a3b48-*
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry h1536e256k6 --batches 1 4 16 64 \
      --workload plain --variants stock tpo tpo_silusep --mem 0.85 --make-room --resume \
      --out "$E/profile-tail-h1536e256k6-silu.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry h1536e256k6 --workload plain tail \
      --variants stock tpo_silusep --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-h1536e256k6-silusep.json" ;;
  siluup)  # issue 37: the gate/up GEMM storing silu(gate) * up at decode (its GLU form; TRUE_ON_POLICY_MOE_SILU=up,
    # opt-in until measured): its bits against silu_mul of the GEMM's rows (every gate/up tile, three geometries, 1-4096
    # tokens; moe with it on and off at both tree widths); the tail profile of h1536e256k6, stock, tpo and tpo_siluup;
    # a3b48's plain, tail and qwen cells, stock (its flashinfer sampling for qwen) against tpo and tpo_siluup
    # (resumable, like space)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-silu-up tests/gpu/test_kernels_gpu.py -k silu_in_up
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry h1536e256k6 --batches 1 4 16 64 \
      --workload plain --variants stock tpo tpo_siluup --mem 0.85 --make-room --resume \
      --out "$E/profile-tail-h1536e256k6-siluup.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 --workload plain tail qwen \
      --variants stock stock_fi tpo tpo_siluup --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room \
      --resume ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-a3b48-siluup.json" ;;
  densetiles)  # issue 37: the dense GEMMs' decode tiles (matmul.dense_decode_tile): the sweep that chose the rule
    # (qkv, router, o_proj_flat over 8 weight copies, 30B-A3B's and h1536e256k6's shapes, every candidate's bits), every
    # plain and grouped decode tile and the GLU form bitwise (three geometries), h1536e256k6's tail profile (stock, tpo,
    # tpo_siluup) and its plain and tail cells; a3b48's plain, tail and qwen cells (resumable, like space); the 48-layer
    # parity; the h1536 truncation stress
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    for g in a3b48 h1536e256k6; do
      run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms qkv router o_proj_flat --tokens 1 4 16 64 \
        --copies 8 --dense-geometry $g --out "$E/bench-dense-decode-$g.json"
    done
    run tier gpu-tier-dense-tiles tests/gpu/test_kernels_gpu.py -k "decode_tiles_equal_pointer or silu_in_up"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry h1536e256k6 --batches 1 4 16 64 \
      --workload plain --variants stock tpo tpo_siluup --mem 0.85 --make-room --resume \
      --out "$E/profile-tail-h1536e256k6-dense.json"
    for g in h1536e256k6 a3b48; do
      w="plain tail"; [ $g = a3b48 ] && w="plain tail qwen"
      run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry $g --workload $w \
        --variants stock tpo --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
        ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-$g-dense.json"
    done
    run $P --mode tpo --trainer patched --geometry a3b48 $DEEP --out "$E/parity-tpo-dense-a3b48-t1.0.json"
    rm -rf "$TRUE_ON_POLICY_CACHE"/qwen3-moe-a3b48-*
    run python3 -m true_on_policy.harness.stress --geometry h1536 --out "$E/stress-truncation-h1536-dense.json" ;;
  attnsplits)  # issue 37: the decode attention's choice times more splits (attention.choice_splits: powers of two
    # that keep a program on every SM, where the rule would not split or splits unevenly): every candidate and split
    # against the fixed tile, bitwise, and the choice's own timings per batch; the 48-layer parity and the h1536
    # truncation stress
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-attention-splits tests/gpu/test_kernels_gpu.py -k attention_tiles
    run $P --mode tpo --trainer patched --geometry a3b48 $DEEP --out "$E/parity-tpo-splits-a3b48-t1.0.json"
    rm -rf "$TRUE_ON_POLICY_CACHE"/qwen3-moe-a3b48-*
    run python3 -m true_on_policy.harness.stress --geometry h1536 --out "$E/stress-truncation-h1536-splits.json" ;;
  flatloop)  # issue 37: the decode attention's flat loop (a tile's loop="flat": one loop over every block of a
    # program's segments). Every candidate tile in both loops, split or not, against the fixed tile, bitwise; the
    # candidates against stock's decode; the start-up choice timing the flat loop (chooser_tiles), its bits and
    # timings; then in a server: h1536e256k6's tail profile and its plain and tail cells, a3b48's plain, tail and qwen
    # cells, the 235B-A22B layer shape's plain and tail cells, stock against tpo (resumable, like space); the 48-layer
    # parity and the h1536 truncation stress
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-attention-flat tests/gpu/test_kernels_gpu.py -k attention_tiles
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/attention_decode.py --geometries a3b48 h1536e256k6 \
      --batches 16 64 256 --stages 2 3 --rounds 3 --out "$E/bench-attention-decode-flat.json"
    run tier gpu-tier-attention-flat-choice tests/gpu/test_kernels_gpu.py -k chosen_at_start_up
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry h1536e256k6 --batches 1 4 16 64 \
      --workload plain --variants stock tpo --mem 0.85 --make-room --resume \
      --out "$E/profile-tail-h1536e256k6-flatloop.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry h1536e256k6 --workload plain tail \
      --variants stock tpo --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-h1536e256k6-flatloop.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 --workload plain tail qwen \
      --variants stock tpo --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-a3b48-flatloop.json"
    run $P --mode tpo --trainer patched --geometry a3b48 $DEEP --out "$E/parity-tpo-flatloop-a3b48-t1.0.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a22b_h200 --workload plain tail \
      --variants stock tpo --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-a22b_h200.json"
    rm -rf "$TRUE_ON_POLICY_CACHE"/qwen3-moe-a22b*
    run python3 -m true_on_policy.harness.stress --geometry h1536 --out "$E/stress-truncation-h1536-flatloop.json" ;;
  prefillflat)  # issue 37: the prefill attention's flat loop (TRUE_ON_POLICY_PREFILL_LOOP=flat, opt-in): every
    # candidate tile's bits in it against the nested loop over mixed prefills and chunks at six head layouts; its
    # time against the nested loop and stock SGLang's extend kernel at plain's prefill and longer ones, the fixed
    # tile and then every candidate; h1536e256k6's plain and tail cells, stock, tpo and tpo_pflat alternated
    # (resumable, like space)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-attention-prefill-flat tests/gpu/test_kernels_gpu.py -k prefill_flat_loop
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/attention_prefill.py --geometries a3b48 h1536e256k6 \
      --rounds 3 --out "$E/bench-attention-prefill-flat.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/attention_prefill.py --geometries h1536e256k6 a3b48 \
      --tiles all --rounds 3 --out "$E/bench-attention-prefill-tiles.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry h1536e256k6 --workload plain tail \
      --variants stock tpo tpo_pflat --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-h1536e256k6-pflat.json" ;;
  segtma)  # issue 37, v1: the tree down projection's weights by TMA (TRUE_ON_POLICY_SEG_TMA=tma, opt-in): its bits
    # against the pointer form (every candidate tile, three geometries, decode and prefill counts), and the pointer
    # form's (the three-partial fold) against ROW_FLAT's and the fixed tile's at every tile; the down GEMM's
    # times on a3b48's shape (both forms, every tile, and the rollout's call with the switch off and on); a3b48's plain
    # and tail cells, tpo_v1 and tpo_v1_segtma alternated (resumable; VARIANTS="stock tpo_v1 tpo_v1_segtma" adds stock)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-seg-tma tests/gpu/test_kernels_gpu.py -k "seg_tree_tma or seg_tree_equals_flat or tree_decode_tiles_equal_fixed"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms down --tokens 1 4 16 64 512 4096 \
      --out "$E/bench-seg-tma.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 --workload plain tail \
      --variants ${VARIANTS:-stock tpo_v1 tpo_v1_segtma} --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http \
      --make-room --resume ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-a3b48-segtma.json" ;;
  segsmem)  # issue 37, v1: the tree down projection with its waiting partials in shared memory (kernels/seg_tree_smem.py,
    # Gluon; timed, in no server): its bits against ROW_FLAT's at every tile it offers, plain and grouped, then the
    # down GEMM's prefill times at a3b48's and the 235B-A22B layer's shapes beside the rollout's call (the start-up
    # choice's tile) and the flat form's (down_flat)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-seg-smem tests/gpu/test_kernels_gpu.py -k "seg_tree_smem"
    for g in a3b48 a22b_h100; do
      run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms down down_flat --moe-geometry "$g" \
        --tokens 512 2048 4096 8192 --forms rollout seg_tree_smem "grouped_matmul" --out "$E/bench-seg-smem-$g.json"
    done ;;
  prefillchoice)  # issue 37: the prefill tile chosen at start-up (TRUE_ON_POLICY_PREFILL_LOOP=choose, opt-in): the
    # choice as the first graph capture runs it at four head layouts, its bits and every candidate's against the
    # default, with the decode choice's tests (the two share their graph timing); h1536e256k6's and a3b48's plain and
    # tail cells, tpo and tpo_pchoose alternated (resumable; VARIANTS="stock tpo tpo_pchoose" adds stock)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-attention-prefill-choice tests/gpu/test_kernels_gpu.py -k "prefill_choice or chosen_at_start_up"
    for g in h1536e256k6 a3b48; do
      run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry $g --workload plain tail \
        --variants ${VARIANTS:-tpo tpo_pchoose} --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room \
        --resume ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-$g-pchoose.json"
    done ;;
  prefilltiles)  # issue 37: the prefill's MoE GEMMs: gate_up and down_flat at prefill token counts over three
    # geometries' MoE shapes, every candidate tile's bits against the reference's; a3b48's op profile at batches 64
    # and 256 with a prefill of 16 requests of 256 tokens (plain's prompt lengths), stock against tpo (resumable)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    for g in a3b48 h1536e256k6 a22b_h200; do
      run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms gate_up down_flat \
        --tokens 512 2048 4096 8192 --moe-geometry $g --out "$E/bench-moe-prefill-$g.json"
    done
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry a3b48 --batches 64 256 \
      --workload plain --variants stock tpo --prefill 4096 --prefill-requests 16 --mem 0.85 --make-room --resume \
      --out "$E/profile-a3b48-prefill16.json" ;;
  moetiles)  # issue 37: the MoE GEMMs' tiles above the decode path by the rows per expert (the default;
    # TRUE_ON_POLICY_MOE_TILES=tokens: by the token count): every tile bitwise the pointer kernel and grouped_matmul's
    # bits in both modes (three geometries, 1 to 4096 tokens); then the 235B-A22B layer shape's plain and qwen cells
    # (the 11 layers an H100 holds): the tuned stocks, tpo in both modes and v1, alternated (resumable, like space)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-moe-tiles tests/gpu/test_kernels_gpu.py -k "grouped_decode_tiles or down_tma_tiles or grouped_tma"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry ${GEOMETRY:-a22b_h100} \
      --workload ${WORKLOADS:-plain qwen} --variants ${VARIANTS:-stock_moe stock_fi_moe tpo tpo_moetok tpo_v1} \
      --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-${GEOMETRY:-a22b_h100}-moetiles.json" ;;
  moeorder)  # issue 37: the MoE GEMMs' programs above the decode path in groups of M blocks (the default;
    # TRUE_ON_POLICY_MOE_ORDER=columns: the column order): the same bits in every order (three geometries, 512 to
    # 8192 tokens); the orders' times at the 235B-A22B layer shape (gate/up and flat down, then v1's tree down);
    # then its plain and qwen cells (11 layers): the tuned stocks, tpo and v1 each in both orders (resumable)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    G=${GEOMETRY:-a22b_h100}
    run tier gpu-tier-moe-order tests/gpu/test_kernels_gpu.py -k program_order
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --moe-geometry "$G" --gemms gate_up down_flat \
      --tokens 512 2048 4096 8192 --out "$E/bench-moe-order-$G.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --moe-geometry "$G" --gemms down \
      --tokens 2048 8192 --out "$E/bench-moe-order-tree-$G.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry "$G" \
      --workload ${WORKLOADS:-plain qwen} --variants ${VARIANTS:-stock_moe stock_fi_moe tpo tpo_moecol tpo_v1 tpo_v1_moecol} \
      --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-$G-moeorder.json" ;;
  v1gap)  # issue 37: what bounds v1 with the MoE GEMMs' programs in groups: v1's tree down projection at every
    # tile in the rollout's order (the 235B-A22B and 30B-A3B shapes), o_proj's tree forms at the 235B-A22B shape,
    # then the 235B-A22B layer shape's plain and qwen cells (GEOMETRY; unset: the depth that fits the card) against
    # both tuned stocks, the default and v1 (resumable)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    G=$(depth ${GEOMETRY:-a22b})
    for m in a22b_h100 a3b48; do
      run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --moe-geometry "$m" --gemms down \
        --tokens 512 2048 4096 8192 --out "$E/bench-tree-down-$m.json"
    done
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --dense-geometry a22b_h100 --gemms o_proj \
      --tokens 2048 4096 --out "$E/bench-tree-oproj-a22b_h100.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry "$G" \
      --workload ${WORKLOADS:-plain qwen} --variants ${VARIANTS:-stock_moe stock_fi_moe tpo tpo_v1} \
      --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-$G-v1gap.json" ;;
  v1rows)  # issue 37: v1's tree down projection above the decode path in the tile timed at start-up for the layer's
    # shape, by the rows per expert (matmul.choose_tree_tiles, the default): first the GPU tier (every candidate's bits
    # in every order of programs and weight fetch, the choice at three shapes and, against the flat loop, at
    # Coder-480B-A35B's segments too wide for ROW_SEG's stages), then the choice against the
    # fixed tile (tpo_v1_treefixed) inside servers: the 235B-A22B layer shape's plain and qwen
    # cells (GEOMETRY; unset: the depth that fits the card) against both tuned stocks with the default, then
    # 30B-A3B's 48 layers' plain and tail against stock (resumable; the v1 parity after it: MOE_TAG=v1rows V1_48=1
    # moeparity). ROWS=<parts>: some of tier, a22b, a3b48 (default: all three, in that order); VARIANTS and
    # WORKLOADS: the 235B-A22B line's; VARIANTS48 and WORKLOADS48: the 48 layers' line's; ROWS_TAG: the files' tag
    # (default v1rows)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    G=$(depth ${GEOMETRY:-a22b})
    ROWS=" ${ROWS:-tier a22b a3b48} "
    [[ $ROWS == *" tier "* ]] && run tier gpu-tier-seg-rows tests/gpu/test_kernels_gpu.py \
      -k "program_order or seg_tree_equals_flat or seg_tree_tma_equals_pointer or tree_tile_choice or wide_segment_choice"
    [[ $ROWS == *" a22b "* ]] && run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry "$G" \
      --workload ${WORKLOADS:-plain qwen} --variants ${VARIANTS:-stock_moe tpo_v1 tpo_v1_treefixed stock_fi_moe tpo} \
      --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-$G-${ROWS_TAG:-v1rows}.json"
    [[ $ROWS == *" a3b48 "* ]] && run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 \
      --workload ${WORKLOADS48:-plain tail} --variants ${VARIANTS48:-stock tpo_v1 tpo_v1_treefixed} --new-tokens 256 \
      --one-engine --repeats 1 --mem 0.85 --http --make-room --resume ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} \
      --out "$E/throughput-space-a3b48-${ROWS_TAG:-v1rows}.json"
    true ;;
  moeparity)  # issue 37's parity acceptance after a change to the MoE GEMMs (MOE_TAG names the files: moetiles,
    # the tiles by the rows per expert; moeorder, the programs in groups): the 235B-A22B layer shape (2 layers; a
    # 4096-token prompt chunked at 2048, then 8 radix-cache hits) and the h1536 truncation stress (a geometry of our
    # own, truncated sampling in the traffic) under the default and under v1, then the 48 layers under the default
    # (and, with V1_48=1, under v1). MOE_CONTRACTS=v1: the short ones under v1 only (a change that moves v1 alone;
    # none: no short ones); NO48=1: not the 48 layers; MOE48=v1: the 48 layers under v1 only
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    T=${MOE_TAG:-moetiles}
    for c in ${MOE_CONTRACTS:-flat v1}; do
      [ $c = none ] && continue
      C=$([ $c = v1 ] && echo "$V1")
      run $P --mode tpo --trainer patched $C --geometry a22b2 $LARGE --out "$E/parity-tpo-$c-a22b2-$T.json"
      run python3 -m true_on_policy.harness.stress --geometry h1536 $C --out "$E/stress-truncation-h1536-$c-$T.json"
    done
    [ "${NO48:-0}" = 1 ] && { echo "NO48=1: the 48 layers not run"; exit $rc; }
    # the 48 layers' 57 GB and a 235B-A22B benchmark checkpoint's 53 GB overfill a 128 GiB host's tmpfs: room first
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/geometries.py --ensure a3b48 --make-room
    for c in ${MOE48:-flat $([ "${V1_48:-0}" = 1 ] && echo v1)}; do
      C=$([ $c = v1 ] && echo "$V1")
      run $P --mode tpo --trainer patched $C --geometry a3b48 $DEEP --out "$E/parity-tpo-$c-a3b48-$T.json"
    done ;;
  wideparity)  # issue 37, v1: parity at the Coder-480B-A35B layer shape (2 layers; a 4096-token prompt chunked at 2048,
    # then 8 radix-cache hits), whose 320-column segments take the tree tile timed at start-up against the flat loop
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run $P --mode tpo --trainer patched $V1 --geometry a35b2 $LARGE \
      --out "$E/parity-tpo-v1-a35b2-${WIDE_TAG:-wide}.json" ;;
  tilechoice)  # issue 37: the decode attention's start-up choice (the default; TRUE_ON_POLICY_DECODE_TILES=fixed
    # turns it off) inside a server: h1536e256k6's plain and qwen cells, stock, tpo (the choice) and tpo_fixed (the
    # fixed tile) alternated (resumable, like space). The robustness group's h1536 stress runs the choice too
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry h1536e256k6 --workload plain qwen \
      --variants stock tpo tpo_fixed --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-h1536e256k6-choice.json" ;;
  segsplit)  # issue 37, v1's prefill, at 1b6b4ca: the tree GEMM with its top levels across programs (kernels/seg_split.py,
    # a candidate the rollout never ran, measured slower and since removed: check that commit out to re-run its tier and
    # sweep as they ran): its bits against seg_tree on the GPU, then its time against the forms in use (the down
    # projection and o_proj at prefill token counts, every candidate's bits checked); then v1's parity on the 48 layers
    # (its numerics are the current code's)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-seg-split tests/gpu/test_kernels_gpu.py -k seg_split
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms down o_proj --tokens 512 2048 4096 8192 \
      --out "$E/bench-seg-split.json"
    run $P --mode tpo --trainer patched $V1 --geometry a3b48 $DEEP --out "$E/parity-tpo-v1-a3b48-t1.0.json" ;;
  contracts)  # issue 37's parity acceptance under both contracts: the 235B-A22B and Coder-480B-A35B layer shapes
    # (2 layers each; mixed lengths plus a 4096-token prompt chunked at 2048, then 8 radix-cache hits) under v1 and under
    # the flat default, and the truncation stress on h1536 (a geometry of our own) under each
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run python3 -m true_on_policy.harness.stress --geometry h1536 $V1 --out "$E/stress-truncation-h1536-v1.json"
    for g in a22b2 a35b2; do
      run $P --mode tpo --trainer patched $V1 --geometry $g $LARGE --out "$E/parity-tpo-v1-$g-t1.0.json"
      run $P --mode tpo --trainer patched --geometry $g $LARGE --out "$E/parity-tpo-flat-$g-t1.0.json"
    done
    run python3 -m true_on_policy.harness.stress --geometry h1536 --out "$E/stress-truncation-h1536-flat.json" ;;
  w2)  # issue 37, v1's bound: the width-2 preview (qwen3_moe_true_on_policy_w2_preview_v1: o_proj and the MoE down
    # projection as two K halves added once, for trainers at TP / expert-TP 1 or 2): its two-segment TMA forms against
    # the pointer kernels' tree and a TP-2 rank's halves, bitwise, at three geometries, and its batch invariance; the
    # two GEMMs' time at 30B-A3B's layer shapes against v1's tree forms and the flat default's loop; parity
    # on the 30B-A3B layer shape (6 layers) and on the 48 layers; the truncation stress on h1536 under it; a3b48's
    # plain and tail cells, stock against v1 and the preview, and their prefill and decode profile (resumable)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    W2="--contract qwen3_moe_true_on_policy_w2_preview_v1"
    run tier gpu-tier-w2 tests/gpu/test_kernels_gpu.py -k "halves_equal_tree or tree_width_2"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gemm_sweep.py --gemms down down_w2 down_flat o_proj o_proj_w2 \
      o_proj_flat --tokens 64 512 4096 8192 --out "$E/bench-w2-gemms.json"
    run $P --mode tpo --trainer patched $W2 --geometry a3b6 --temperature 1.0 --out "$E/parity-tpo-w2-a3b6-t1.0.json"
    run python3 -m true_on_policy.harness.stress --geometry h1536 $W2 --out "$E/stress-truncation-h1536-w2.json"
    run $P --mode tpo --trainer patched $W2 --geometry a3b48 $DEEP --out "$E/parity-tpo-w2-a3b48-t1.0.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/throughput.py --geometry a3b48 --workload plain tail \
      --variants stock tpo_v1 tpo_w2 --new-tokens 256 --one-engine --repeats 1 --mem 0.85 --http --make-room --resume \
      ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} --out "$E/throughput-space-a3b48-w2.json"
    run env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/op_profile.py --geometry a3b48 --batches 1 4 16 64 \
      --prefill 4096 --workload plain --variants stock tpo_v1 tpo_w2 --mem 0.85 --make-room --resume \
      --out "$E/profile-tail-a3b48-w2.json" ;;
  sampler)  # issue 37, the sampler's last change (an untruncated draw allocates no zeros: the row lse at z = 0 inside
    # the finish kernel, no greedy flags read when no row can be greedy): the sampling, truncation and token log-prob
    # GPU tests; the h1536 truncation stress; parity on the 235B-A22B layer shape and on the 48 layers (the issue's
    # parity acceptance, under the default contract)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    run tier gpu-tier-sampling-nozeros tests/gpu/test_sampling_gpu.py tests/gpu/test_truncation_top_gpu.py \
      tests/gpu/test_truncation_gpu.py tests/gpu/test_kernels_gpu.py tests/gpu/test_kernels_layouts_gpu.py \
      -k "sampl or trunc or token_logprobs or lse"
    run python3 -m true_on_policy.harness.stress --geometry h1536 --out "$E/stress-truncation-h1536-nozeros.json"
    run $P --mode tpo --trainer patched --geometry a22b2 $LARGE --out "$E/parity-tpo-nozeros-a22b2-t1.0.json"
    rm -rf "$TRUE_ON_POLICY_CACHE"/*a22b2*
    run $P --mode tpo --trainer patched --geometry a3b48 $DEEP --out "$E/parity-tpo-nozeros-a3b48-t1.0.json" ;;
  tp2)
    run tier gpu-tier-collectives tests/gpu/test_kernels_dist_gpu.py
    run python3 -m true_on_policy.harness.parity --mode tpo --trainer patched --contract qwen3_moe_true_on_policy_tp_preview_v1 \
      --tp-size 2 --prompts 16 --new-tokens 32 --cuda-graph-max-bs 16 --out "$E/parity-tpo-tp2-embedded.json"
    for g in a22b2 a35b2; do
      run $P --mode tpo --trainer patched --contract qwen3_moe_true_on_policy_tp_preview_v1 --tp-size 2 --geometry $g \
        --temperature 1.0 --long-prompts 1 --long-len 4096 --chunked-prefill-size 2048 --radix-followups 8 \
        --out "$E/parity-tpo-tp2-$g-t1.0.json"
    done ;;
  robustness|all)  # no request and no weight update crashes the server (a 3000-request fuzz, bad updates), and
    # truncated sampling in mixed concurrent traffic with weight updates, bitwise on the 30B-A3B layer shape and an own
    # geometry; the kernel-level truncation test; the 6-layer parity under the default contract
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo}
    run python3 -m true_on_policy.harness.robustness --out "$E/robustness-embedded.json"
    run python3 -m true_on_policy.harness.stress --geometry a3b6 --out "$E/stress-truncation-a3b6.json"
    run python3 -m true_on_policy.harness.stress --geometry h1536 --out "$E/stress-truncation-h1536.json"
    run tier gpu-tier-truncation tests/gpu/test_truncation_gpu.py
    run $P --mode tpo --trainer patched --temperature 1.0 --geometry a3b6 --out "$E/parity-tpo-default-a3b6-t1.0.json"
    run tier gpu-tier-robustness tests/gpu/test_engine_gpu.py tests/gpu/test_sampling_http_gpu.py
    run tier gpu-tier-sampling tests/gpu/test_sampling_gpu.py tests/gpu/test_sampling_engine_gpu.py \
      tests/gpu/test_server_gpu.py ;;&
  pp2)
    run python3 -m true_on_policy.harness.parity --mode tpo --trainer patched --contract qwen3_moe_true_on_policy_tp_preview_v1 \
      --pp-size 2 --prompts 64 --new-tokens 64 --out "$E/parity-tpo-pp2-embedded.json"
    run tier gpu-tier-pp2 tests/gpu/test_pp_gpu.py ;;
  colocated)  # issue 38: GRPO colocated on one GPU through Ray (SGLang's memory saver, weights over CUDA IPC) at the
    # 30B-A3B layer shape with 6 layers: 100 steps with the HF trainer; 20 with the Megatron-core trainer (TP1); the
    # per-step cost: 20 HF steps, then 20 with stock SGLang and stock transformers in the same run; the Ray, Megatron and
    # colocated GPU tests. Needs Ray and megatron-core (tests/gpu/extra-requirements.txt).
    # PART=hf|megatron|cost|backward|tests runs one line (one device call each)
    export TRUE_ON_POLICY_CACHE=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}
    part() { [ "${PART:-all}" = all ] || [ "${PART:-all}" = "$1" ]; }
    C="python3 -m true_on_policy.harness.colocated --geometry a3b6"
    part hf && run $C --trainer hf --steps 100 --out "$E/colocated-hf-a3b6.json"
    part megatron && run $C --trainer megatron --steps 20 --out "$E/colocated-megatron-a3b6.json"
    part cost && run $C --trainer hf --steps 20 --stock --stock-steps 20 --out "$E/colocated-cost-a3b6.json"
    part backward && run env PYTHONPATH=.:benchmarks:${PYTHONPATH:-} python3 benchmarks/trainer_backward.py --geometry a3b6 \
      --shape 16x96 4x1024 --repeats 3 --out "$E/trainer-backward-a3b6.json"
    part tests && run tier gpu-tier-colocated tests/gpu/test_ray_gpu.py tests/gpu/test_megatron_gpu.py \
      tests/gpu/test_colocated_gpu.py ;;
  parity|kernels|trainer|rollout|acceptance|realshape|realshape48|largeshapes|longctx|rl|robustness|decodetiles|widedecode|truncselect|all) ;;
  *) echo "unknown group $GROUP" >&2; exit 2 ;;
esac
exit $rc
