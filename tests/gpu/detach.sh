#!/usr/bin/env bash
# Run regenerate_evidence.sh groups detached from the calling shell, one after another before a deadline, and
# gather what they write: for a GPU lent as a series of time-limited commands, where a group outlasts one command.
#
#   TRUE_ON_POLICY_GIT_COMMIT=<commit> MODE=start JOBS_FILE=F DEADLINE=<epoch s> END_AT=<epoch s> OUT=<dir> \
#     bash tests/gpu/detach.sh       # copy the checkout, start the jobs, then watch
#   MODE=watch END_AT=<epoch s> OUT=<dir> bash tests/gpu/detach.sh          # watch again, from a later command
#
# JOBS_FILE: one job a line, NAME GROUP [VAR=value ...] (bash words: quote a value with spaces); the variables go to the
# group, RESERVE=<s> keeps that many seconds of the deadline for the jobs after it, and MIN=<s> (default 60) is the
# least a job needs to start. A job gets what is left before DEADLINE less its RESERVE as TIME_BUDGET (the throughput
# lines stop before a pass that would not end in it) and is killed at the deadline; one with less than its MIN left
# (less its RESERVE) is skipped, so a watch sees ALL-DONE early rather than waiting out a job that can do nothing
# useful. The copy ($W, without .git) records TRUE_ON_POLICY_GIT_COMMIT as the commit it claims (provenance --verify
# checks it against the source); a claim that is not a full hash, or that this checkout's git history holds and that
# does not hash as the copy, stops the start with exit 2 and nothing run; the driver and its logs live in the copy's
# .detach/, which the source hash leaves out, so the copy hashes as the checkout.
# Watching waits until END_AT or the last job's end, then puts under $OUT/ev the evidence files written since the
# start (also as new-evidence.tgz, whole folders kept), jobs.log (each job's start, seconds left and exit status)
# and the tail of each job's log; it prints jobs.log, ALL-DONE once every job ended, and each log's last lines.
set -uo pipefail
W=${W:-/tmp/tpo-detach}
REGEN=${REGEN:-tests/gpu/regenerate_evidence.sh}
if [ "${MODE:-watch}" = start ]; then
  : "${TRUE_ON_POLICY_GIT_COMMIT:?the commit this checkout is}" "${JOBS_FILE:?}" "${DEADLINE:?}"
  rm -rf "$W" && mkdir -p "$W/.detach/logs"
  tar --exclude=./.git --exclude=./.gpu-bundle -cf - . | tar -xf - -C "$W"
  # the claim is a full commit hash; where this checkout's git history holds it, it must hash as the copy
  [[ $TRUE_ON_POLICY_GIT_COMMIT =~ ^[0-9a-f]{40}$ ]] || {
    echo "detach.sh: TRUE_ON_POLICY_GIT_COMMIT=$TRUE_ON_POLICY_GIT_COMMIT is not a full commit hash" \
      "(git rev-parse HEAD); nothing started" >&2
    exit 2; }
  if git cat-file -e "$TRUE_ON_POLICY_GIT_COMMIT^{commit}" 2> /dev/null; then
    PYTHONPATH=".:${PYTHONPATH:-}" python3 - "$TRUE_ON_POLICY_GIT_COMMIT" "$W" <<'CHECK' || exit 2
import sys
from true_on_policy.harness import provenance as p
claimed, copy = sys.argv[1], p.source_sha256(sys.argv[2])
if p.source_sha256_at(claimed, ".") != copy:
    found = p.commit_with_source(copy, ".")
    sys.exit(f"detach.sh: TRUE_ON_POLICY_GIT_COMMIT={claimed} is not the source of this checkout "
             f"({'it is ' + found if found else 'no commit of its history is'}); nothing started")
CHECK
  else
    echo "detach.sh: $TRUE_ON_POLICY_GIT_COMMIT is not in this checkout's git history; claimed unchecked"
  fi
  cp "$JOBS_FILE" "$W/.detach/jobs.txt"
  touch "$W/.detach/stamp"
  cat > "$W/.detach/run.sh" <<'RUN'
cd "$W" || exit 1
D=.detach
while read -r line; do
  [ -z "${line// }" ] && continue
  eval "set -- $line"
  name=$1 group=$2; shift 2
  reserve=0 min=60 vars=()
  for v in "$@"; do
    case $v in RESERVE=*) reserve=${v#RESERVE=} ;; MIN=*) min=${v#MIN=} ;; *) vars+=("$v") ;; esac
  done
  left=$(( DEADLINE - $(date +%s) ))
  if [ $((left - reserve)) -lt "$min" ]; then
    echo "$(date +%T) $name skipped: $left s left, $reserve reserved, $min needed" >> $D/jobs.log; continue
  fi
  echo "$(date +%T) $name start ($group ${vars[*]}), $left s left" >> $D/jobs.log
  timeout "$left" env PYTHONUNBUFFERED=1 TIME_BUDGET=$((left - reserve)) "${vars[@]}" bash "$REGEN" "$group" \
    > "$D/logs/$name.log" 2>&1
  rc=$?  # 124: killed at the deadline
  echo "$(date +%T) $name rc=$rc" >> $D/jobs.log
done < $D/jobs.txt
touch $D/done
RUN
  (W="$W" REGEN="$REGEN" DEADLINE="$DEADLINE" TRUE_ON_POLICY_GIT_COMMIT="$TRUE_ON_POLICY_GIT_COMMIT" \
    setsid nohup bash "$W/.detach/run.sh" > "$W/.detach/logs/driver.log" 2>&1 &)
fi
: "${END_AT:?}" "${OUT:?}"
while [ "$(date +%s)" -lt "$END_AT" ] && [ ! -e "$W/.detach/done" ]; do sleep 5; done
mkdir -p "$OUT/ev"
(cd "$W" && find evidence -type f -newer .detach/stamp -print0 | tar --null -T - -czf "$OUT/ev/new-evidence.tgz")
tar -xzf "$OUT/ev/new-evidence.tgz" -C "$OUT/ev"
cp "$W/.detach/jobs.log" "$OUT/ev/" 2>/dev/null
for f in "$W"/.detach/logs/*.log; do [ -e "$f" ] && tail -c 60000 "$f" > "$OUT/ev/$(basename "$f")"; done
cat "$W/.detach/jobs.log" 2>/dev/null
[ -e "$W/.detach/done" ] && echo ALL-DONE
for f in "$W"/.detach/logs/*.log; do [ -e "$f" ] && { echo "== $(basename "$f")"; tail -n 15 "$f"; }; done
true
