#!/usr/bin/env bash
# The GPU tier in one command, on any machine with an NVIDIA GPU and sglang 0.5.17 installed:
#   bash tests/gpu/run_gpu_tier.sh [OUT_DIR]          (default OUT_DIR: evidence/gpu-run)
# Runs `pytest -m gpu` (evidence: OUT_DIR/gpu-tier.json) and the parity harness on the embedded
# model (OUT_DIR/parity-{stock,tpo}-embedded.json): stock SGLang against stock transformers, and
# --true-on-policy against the patched transformers trainer (the bitwise claim). Every log starts
# with a provenance line (python -m true_on_policy.harness.provenance --log); on a copy without .git, set
# TRUE_ON_POLICY_GIT_COMMIT to the commit it was made from.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-evidence/gpu-run}
mkdir -p "$OUT_DIR"
export TRUE_ON_POLICY_EVIDENCE_DIR=$OUT_DIR PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "from importlib.metadata import entry_points as e; assert any(x.name == 'true_on_policy' for x in e(group='sglang.srt.plugins'))" 2>/dev/null \
  || bash tests/gpu/dev_install.sh || exit 1
logged() { python3 -m true_on_policy.harness.provenance --log "$@"; }
rc=0
for mode in ${PARITY_MODES:-stock tpo}; do
  trainer=hf; [ "$mode" = tpo ] && trainer=patched
  logged "$OUT_DIR/parity-$mode.log" -- python3 -m true_on_policy.harness.parity --mode "$mode" --trainer "$trainer" \
    --prompts "${PARITY_PROMPTS:-64}" --new-tokens "${PARITY_NEW_TOKENS:-64}" --out "$OUT_DIR/parity-$mode-embedded.json" \
    || { rc=1; echo "parity $mode FAILED"; }
  tail -n 1 "$OUT_DIR/parity-$mode.log"
done
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
logged "$OUT_DIR/pytest-gpu.log" -- python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu ${PYTEST_ARGS:-}
prc=$?
tail -n 25 "$OUT_DIR/pytest-gpu.log"
exit $(( rc || prc ))
