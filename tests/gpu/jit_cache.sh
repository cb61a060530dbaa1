#!/usr/bin/env bash
# Carry the GPU host's compile caches from one lease to the next: Triton's compiled kernels, flashinfer's JIT
# modules, SGLang's JIT kernels (built through tvm-ffi, keyed by source, arch and ABI) and the stock MoE tiles tuned
# per checkpoint shape (benchmarks/stock_moe.py, under TRUE_ON_POLICY_CACHE).
# A fresh machine builds them again at each engine's first start; restored, the next lease starts warm. They are
# caches only: Triton and flashinfer key every entry by its source, compiler and target, and stock_moe.py tunes again
# on another card or Triton, so a stale entry is rebuilt, never used, and no number but a start time changes.
# Evidence written after a restore names it (provenance's compile_caches).
#
#   bash tests/gpu/jit_cache.sh save DIR      # pack them into DIR/jit-NN (parts of PART_MIB, default 15) and
#                                             # DIR/jit.parts, DIR/jit.sha256: at most 8 files, one call's return
#   bash tests/gpu/jit_cache.sh restore DIR   # stash DIR's parts (over several calls if need be); once all are
#                                             # there, unpack them (exit 3: parts still missing, 4: checksum)
#
# save leaves out Triton's cache (flashinfer's, SGLang's JIT and the tunings are small) when the whole would take
# more than MAX_PARTS parts (default 6), and saves nothing (exit 5) where even that would; the parts are
# xz-compressed tar of absolute paths.
set -euo pipefail
MODE=${1:?save or restore}
DIR=$(realpath -m -- "${2:?a folder}")  # absolute: restore joins the parts from inside the stash
TRITON_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
FI_DIR=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
TVM_DIR=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}
TUNED_DIR=${TRUE_ON_POLICY_CACHE:-/dev/shm/tpo-cache}/stock-moe
STASH=${JIT_STASH:-/tmp/tpo-jit-stash}
MARK=$HOME/.cache/true_on_policy/compile-caches.json  # provenance.compile_caches reads it
PART=$(( ${PART_MIB:-15} * 1024 * 1024 )) MAX=${MAX_PARTS:-6}

pack() {  # pack DEST DIRS...: the existing folders, as paths below /
  local dest=$1 rel=() d; shift
  for d in "$@"; do [ -d "$d" ] && rel+=("${d#/}"); done
  [ ${#rel[@]} -gt 0 ] || { echo "jit_cache.sh: none of $* exists; nothing saved" >&2; return 1; }
  tar -C / -cf - "${rel[@]}" | xz -6 -T0 > "$dest"
  echo "${rel[*]}"
}
mib() { echo $(( $(stat -c %s "$1") >> 20 )); }
fits() { [ $(( ($(stat -c %s "$1") + PART - 1) / PART )) -le "$MAX" ]; }  # fits FILE: in at most MAX parts

case $MODE in
  save)
    du -sh "$HOME"/.cache/* "$HOME"/.triton/* >&2 2> /dev/null || true  # what else a first start built
    mkdir -p "$DIR" && rm -f "$DIR"/jit-* "$DIR"/jit.parts "$DIR"/jit.sha256
    tmp=$(mktemp) && trap 'rm -f "$tmp"' EXIT
    kept=$(pack "$tmp" "$TRITON_DIR" "$FI_DIR" "$TVM_DIR" "$TUNED_DIR")
    if ! fits "$tmp"; then
      echo "jit_cache.sh: $(mib "$tmp") MiB with Triton's cache, over $MAX parts:" \
        "saving flashinfer's and SGLang's JIT caches and the tunings alone" >&2
      kept=$(pack "$tmp" "$FI_DIR" "$TVM_DIR" "$TUNED_DIR")
      fits "$tmp" || { echo "jit_cache.sh: $(mib "$tmp") MiB even without it; nothing saved" >&2; exit 5; }
    fi
    split -b "$PART" -d -a 2 "$tmp" "$DIR/jit-"
    (cd "$DIR" && ls jit-[0-9][0-9] > jit.parts)
    sha256sum "$tmp" | cut -c1-64 > "$DIR/jit.sha256"
    echo "jit_cache.sh: saved /${kept// / \/} as $(wc -l < "$DIR/jit.parts") part(s)," \
      "$(mib "$tmp") MiB, sha256 $(cat "$DIR/jit.sha256")" ;;
  restore)
    [ -f "$DIR/jit.parts" ] && [ -f "$DIR/jit.sha256" ] || { echo "jit_cache.sh: no jit.parts in $DIR" >&2; exit 2; }
    mkdir -p "$STASH"
    for p in "$DIR"/jit-[0-9][0-9]; do [ -f "$p" ] && cp -f "$p" "$STASH/"; done
    missing=()
    while read -r p; do [ -f "$STASH/$p" ] || missing+=("$p"); done < "$DIR/jit.parts"
    if [ ${#missing[@]} -gt 0 ]; then
      echo "jit_cache.sh: stashed; still missing ${missing[*]} (carry them in the next call)" >&2
      exit 3
    fi
    want=$(cat "$DIR/jit.sha256")
    whole=$(mktemp) && trap 'rm -f "$whole"' EXIT
    (cd "$STASH" && cat $(cat "$DIR/jit.parts")) > "$whole"  # the parts joined once, checked, then unpacked
    got=$(sha256sum "$whole" | cut -c1-64)
    [ "$got" = "$want" ] || { echo "jit_cache.sh: checksum $got, not $want: parts of two saves" >&2; exit 4; }
    xz -d < "$whole" | tar -C / -xf -
    mkdir -p "$(dirname "$MARK")"
    printf '{"sha256": "%s", "restored_at": "%s"}\n' "$want" "$(date -u +%FT%TZ)" > "$MARK"
    echo "jit_cache.sh: restored $want" ;;
  *) echo "jit_cache.sh: save or restore, not $MODE" >&2; exit 2 ;;
esac
