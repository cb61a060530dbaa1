#!/usr/bin/env bash
# Make the checkout importable and its sglang plugin entry point visible on a machine without
# a package index: an editable install when the local setuptools can build one, else a .pth
# file plus a hand-written .dist-info carrying the entry point (what an editable install does).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null && exit 0
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD" > "$SITE/true_on_policy_checkout.pth"
DI="$SITE/true_on_policy_sglang-0.1.0.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: true-on-policy-sglang\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[sglang.srt.plugins]\ntrue_on_policy = true_on_policy.plugin:register\n' > "$DI/entry_points.txt"
python3 -c "from importlib.metadata import entry_points as e; assert any(x.name == 'true_on_policy' for x in e(group='sglang.srt.plugins'))"
echo "[dev_install] checkout on sys.path via $SITE/true_on_policy_checkout.pth (no setuptools build)"
